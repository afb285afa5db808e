"""``sglang-cp-hicache fleet``: several deployments behind a router on one L3.

Exit status: 0 when every deployment finished its requests with its own
checks passed, no page anywhere was corrupted and some page was verified;
1 otherwise (the table's ``problem:`` lines and the JSON's ``problems`` say
why; a failed deployment's log is kept); 2 for bad flags, found before any
deployment starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Optional, Union

from sglang_cp_hicache.sim.cli_flags import DEFAULT_ENGINE, ENGINES
from sglang_cp_hicache.sim.config import (
    DSA_PAGE_SIZE,
    FAIL_ENV,
    check_seconds,
    default_startup_timeout_s,
    parse_failure_injection,
)
from sglang_cp_hicache.sim.fleet.coordinator import Deployment, run_fleet
from sglang_cp_hicache.sim.fleet.l3 import FleetL3, check_fleet_l3
from sglang_cp_hicache.sim.fleet.report import FleetFacts, fleet_summary, format_fleet_table
from sglang_cp_hicache.sim.fleet.router import ROUTES, AffinityParams, make_router
from sglang_cp_hicache.sim.fleet.spec import DeploymentSpec, parse_deployment, parse_python, python_for
from sglang_cp_hicache.sim.ideal import ideal_cache
from sglang_cp_hicache.sim.mooncake_l3 import OWN_CLUSTER, is_mooncake, master_binary, mooncake_missing
from sglang_cp_hicache.sim.outputs import OutputPathError, check_output_paths
from sglang_cp_hicache.sim.sizing import DEFAULT_CAPACITY
from sglang_cp_hicache.sim.workload import TraceError, load_trace

__all__ = ["add_fleet_parser", "run_fleet_command"]

SCOPES = ("fleet", "deployment")


def add_fleet_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fleet", allow_abbrev=False,
        help="replay a trace across several CP deployments (mixed releases and CP sizes) behind a router, "
             "sharing one L3",
        description="Each --deployment is one simulate run (its own rank group, started by its release's "
                    "Python) on --engine; a coordinator releases the trace's requests in order, each to the "
                    "deployment --route picks, the next only once the last has started (scheduler engine: was "
                    "submitted to SGLang's scheduler; loop engine: began serving).",
    )
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                   help="what runs each deployment: 'scheduler', SGLang's own Scheduler and event loop (requests "
                        "submitted as released, at most --in-flight unfinished per deployment, batched by SGLang; "
                        "--l3 DIR only, every deployment at CP >= 2 with --l3), or 'loop', the simulator's own "
                        f"loop (one request at a time; Mooncake and fault injection) (default {DEFAULT_ENGINE})")
    p.add_argument("--in-flight", type=int, default=None, metavar="N",
                   help="--engine scheduler: requests a deployment holds submitted and unfinished at most "
                        "(default: its max running requests, 8)")
    p.add_argument("--deployment", action="append", required=True, metavar="RELEASE:cpN[:device=D][:host=H]",
                   help="one deployment (repeat for more): SGLang release, CP size, and optionally its device "
                        "and host pages per rank (default: sized from the trace with --capacity)")
    p.add_argument("--trace", required=True, metavar="FILE.jsonl", help="the trace every deployment replays a part of")
    p.add_argument("--requests", type=int, default=None, metavar="R", help="the trace's first R requests (default all)")
    p.add_argument("--trace-block-tokens", type=int, default=None, metavar="B",
                   help="Mooncake trace: tokens per hash id (default 64)")
    p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY, metavar="F",
                   help="pools of a deployment without device=/host=: sized as simulate --capacity F sizes them "
                        f"from the whole trace's distinct pages at that deployment's CP size (default "
                        f"{DEFAULT_CAPACITY})")
    p.add_argument("--layers", type=int, default=2, metavar="L", help="KV and indexer layers (default 2)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="content seed (default 0)")
    p.add_argument("--l3", metavar="DIR|mooncake|mooncake://HOST:PORT", default=None,
                   help="the L3 the deployments share: a file store in DIR; 'mooncake': a Mooncake cluster the "
                        "fleet starts on loopback (one mooncake_master, every CP rank's client lending "
                        "--mooncake-segment; stopped at the end); or mooncake://HOST:PORT, a running master. "
                        "Mooncake needs the mooncake wheel in every deployment's environment")
    p.add_argument("--l3-scope", choices=SCOPES, default="fleet",
                   help="'fleet': every deployment on one store; 'deployment': each its own (what rank-keyed "
                        "stores allow), for comparison: DIR/<name>, or with --l3 mooncake one master per "
                        "deployment, its store made of its own ranks' segments (default fleet)")
    p.add_argument("--mooncake-segment", metavar="SIZE", default=None,
                   help="Mooncake: the memory each CP rank's client lends the store ('64mb', '1gb' or bytes, at "
                        "least 16mb; default 64mb), so a deployment of CP N lends N segments")
    p.add_argument("--route", choices=ROUTES, default="round-robin", help="how requests are routed (default "
                   "round-robin); prefix-affinity is SGLang's router's cache_aware policy")
    p.add_argument("--cache-threshold", type=float, default=AffinityParams.cache_threshold,
                   help="prefix-affinity: the match rate above which the longest match wins (default 0.5)")
    p.add_argument("--balance-abs-threshold", type=int, default=AffinityParams.balance_abs_threshold,
                   help="prefix-affinity: the outstanding-request gap that, with the relative one, means "
                        "imbalance (default 32)")
    p.add_argument("--balance-rel-threshold", type=float, default=AffinityParams.balance_rel_threshold,
                   help="prefix-affinity: max outstanding above this times min means imbalance (default 1.0001)")
    p.add_argument("--python", action="append", default=[], metavar="RELEASE=PATH",
                   help="the interpreter for a release's deployments (default: the checkout's .venv / .venv-0523)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the fleet's summary as JSON")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG: cumulative hits per tier against the ideal over the trace, per deployment")
    p.add_argument("--collective-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="each deployment's gloo timeout (default 60)")
    p.add_argument("--startup-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long the deployments get to start (default: simulate's for the largest CP size)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    # test hook: FAIL_ENV's RANK:STEP:MODE for deployment D only
    p.add_argument("--fault", metavar="D:RANK:STEP:MODE", default=None, help=argparse.SUPPRESS)
    # test hook: --l3 mooncake, the master SIGKILLed and started again on its port once request I started
    p.add_argument("--fault-master-restart", metavar="I", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_fleet_command)
    return p


def _error(message: str, code: int = 2) -> int:
    print(f"sglang-cp-hicache fleet: error: {message}", file=sys.stderr)
    return code


def _installed() -> str:
    from sglang_cp_hicache.sim.cli import installed_sglang

    return installed_sglang()


def _fault(text: Optional[str], count: int) -> Optional[tuple[int, str]]:
    if text is None:
        return None
    position, sep, rest = text.partition(":")
    if not sep or not position.isdigit() or int(position) >= count:
        raise ValueError(f"--fault {text}: expected D:RANK:STEP:MODE with D a deployment's position (< {count})")
    parse_failure_injection(rest)  # ValueError naming the format
    return int(position), rest


def _check(args: argparse.Namespace) -> Union[str, tuple[list[DeploymentSpec], dict[str, str]]]:
    """Every flag checked before anything starts: the deployments and their interpreters, or an error."""
    try:
        specs = [parse_deployment(text) for text in args.deployment]
        overrides = dict(parse_python(text) for text in args.python)
        installed = _installed()
        pythons = {s.release: python_for(s.release, overrides, installed) for s in specs}
        check_seconds("--collective-timeout", args.collective_timeout)
        if args.startup_timeout is not None:
            check_seconds("--startup-timeout", args.startup_timeout)
        AffinityParams(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold)
        _fault(args.fault, len(specs))
    except (TypeError, ValueError) as exc:
        return str(exc)
    if args.requests is not None and args.requests < 1:
        return f"--requests must be a positive integer, got {args.requests}"
    if not 0.0 < args.capacity <= 1.0:
        return f"--capacity must be in (0, 1], got {args.capacity}"
    # check_fleet_l3 last but one: it creates an L3 directory, which only a fleet that will start may
    problem = (_restart_problem(args) or _engine_problem(args, specs)
               or check_fleet_l3(args.l3, args.l3_scope, args.mooncake_segment)
               or _mooncake_problem(args, specs, pythons))
    if problem is not None:
        return problem
    return specs, pythons


def _engine_problem(args: argparse.Namespace, specs: list[DeploymentSpec]) -> Optional[str]:
    """Why --engine cannot run these deployments (None if it can)."""
    if args.engine == "loop":
        return "--in-flight needs --engine scheduler" if args.in_flight is not None else None
    if args.in_flight is not None and args.in_flight < 1:
        return f"--in-flight must be a positive integer, got {args.in_flight}"
    if is_mooncake(args.l3):
        return f"--l3 {args.l3} needs --engine loop: the scheduler engine's L3 is a file directory"
    if args.fault is not None or args.fault_master_restart is not None:
        return "fault injection needs --engine loop"
    small = [f"{s.release}:cp{s.cp_size}" for s in specs if s.cp_size < 2]
    if args.l3 is not None and small:
        return (f"--deployment {small[0]}: --engine scheduler with --l3 needs CP >= 2 (at CP 1 SGLang builds "
                "its own cache and storage backend, not this library's); add --engine loop")
    return None


def _restart_problem(args: argparse.Namespace) -> Optional[str]:
    restart = args.fault_master_restart
    if restart is not None and (args.l3 != OWN_CLUSTER or args.l3_scope != "fleet" or restart < 0
                                or (args.requests is not None and restart >= args.requests)):
        return (f"--fault-master-restart {restart}: needs --l3 mooncake, --l3-scope fleet and a request index "
                "below --requests")
    return None


def _mooncake_problem(args: argparse.Namespace, specs: list[DeploymentSpec], pythons: dict[str, str]) -> Optional[str]:
    """Why a Mooncake L3 cannot run here: no master to start, or a
    deployment's environment without the wheel."""
    if not is_mooncake(args.l3):
        return None
    if args.l3 == OWN_CLUSTER and master_binary() is None:
        return f"--l3 mooncake: no mooncake_master to start: {sys.executable} has no mooncake wheel"
    for spec in specs:
        missing = mooncake_missing(pythons[spec.release])
        if missing is not None:
            return f"--l3 {args.l3}: --deployment {spec.release}:cp{spec.cp_size}: {missing}"
    return None


def _deployments(args: argparse.Namespace, specs: list[DeploymentSpec], pythons: dict[str, str],
                 logs: str, store: FleetL3) -> list[Deployment]:
    fault = _fault(args.fault, len(specs))
    out = []
    for position, spec in enumerate(specs):
        name = spec.name(position)
        json_path = os.path.join(logs, f"{name}.json")
        cmd = [pythons[spec.release], "-m", "sglang_cp_hicache", "simulate", "--engine", args.engine, "--no-progress",
               "--allow-unverified", "--sglang", spec.release, "--cp-size", str(spec.cp_size), "--trace", os.path.abspath(args.trace),
               "--layers", str(args.layers), "--seed", str(args.seed), "--json", json_path,
               "--collective-timeout", str(args.collective_timeout)]
        for flag, value in (("--requests", args.requests), ("--trace-block-tokens", args.trace_block_tokens),
                            ("--device-pages", spec.device_pages), ("--host-pages", spec.host_pages),
                            # the scheduler harness has its own start-up limit
                            ("--startup-timeout", args.startup_timeout if args.engine == "loop" else None),
                            ("--in-flight", args.in_flight)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += store.flags(name)
        if spec.device_pages is None or spec.host_pages is None:
            cmd += ["--capacity", str(args.capacity)]
        if spec.release == "0.5.23":
            cmd += ["--copy", "library"]  # upstream's sharded stack refuses storage
        env = dict(os.environ)
        env.pop(FAIL_ENV, None)
        if fault is not None and fault[0] == position:
            env[FAIL_ENV] = fault[1]
        out.append(Deployment(spec=spec, name=name, command=cmd, l3_dir=store.where(name), json_path=json_path,
                              log_path=os.path.join(logs, f"{name}.log"), env=env,
                              readers=spec.cp_size if args.engine == "loop" else 1))
    return out


def run_fleet_command(args: argparse.Namespace) -> int:
    checked = _check(args)
    if isinstance(checked, str):
        return _error(checked)
    specs, pythons = checked
    if args.plot is not None:
        from sglang_cp_hicache.sim.plot import PlotUnavailable, check_matplotlib

        try:
            check_matplotlib()
        except PlotUnavailable as exc:
            return _error(str(exc))
    try:
        check_output_paths({"--json": args.json, "--plot": args.plot}, inputs={"--trace": args.trace})
        trace = load_trace(args.trace, seed=args.seed, limit=args.requests, block_tokens=args.trace_block_tokens)
    except (OutputPathError, TraceError, ValueError) as exc:
        return _error(str(exc))
    packed = trace.packed
    requests = [packed[i] for i in range(len(packed))]
    page_size = DSA_PAGE_SIZE  # what both releases' DSA pools take
    store = FleetL3(args.l3, args.l3_scope, args.mooncake_segment)
    facts = FleetFacts(engine=args.engine, route=args.route, l3_scope=args.l3_scope if args.l3 is not None else None,
                       l3_dir=store.label, page_size=page_size,
                       prompt_tokens=[len(r) for r in requests],
                       ideal_hit_tokens=ideal_cache(requests, page_size).hit_tokens, workload=f"trace:{args.trace}")
    logs = tempfile.mkdtemp(prefix="sglang-cp-hicache-fleet-")
    try:
        store.open([spec.name(k) for k, spec in enumerate(specs)], logs)
    except RuntimeError as exc:
        store.stop()
        return _error(f"--l3 {args.l3}: {exc}", 1)
    deps = _deployments(args, specs, pythons, logs, store)
    router = make_router(args.route, len(deps), page_size,
                         AffinityParams(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold))
    # every deployment's ranks import SGLang at once: simulate's allowance for all of them together
    startup = args.startup_timeout if args.startup_timeout is not None else default_startup_timeout_s(
        sum(s.cp_size for s in specs))
    restart = args.fault_master_restart

    def fault(i: int) -> None:
        if i == restart:  # every rank of a live deployment is a client
            store.restart_master(i, sum(d.spec.cp_size for d in deps if d.alive))

    try:
        run = run_fleet(deps, requests, router, startup_timeout_s=startup,
                        finish_timeout_s=args.collective_timeout + 60.0, show_progress=not args.no_progress,
                        measure=store.sample, store_ends_with_clients=store.mooncake,
                        on_started=None if restart is None else fault)
    finally:
        store.stop()
    summary = fleet_summary(run, facts, requests, store.as_dict())
    print(format_fleet_table(summary))
    if summary["ok"]:
        shutil.rmtree(logs, ignore_errors=True)  # kept only for a failed run
    else:
        print(f"logs of every deployment: {logs}", file=sys.stderr)
    from sglang_cp_hicache.sim.cli import write_outputs
    from sglang_cp_hicache.sim.fleet.plot import plot_fleet

    written = write_outputs(args, summary, plot=plot_fleet, command="fleet")
    return written or (0 if summary["ok"] else 1)
