"""``sglang-cp-hicache simulate``: flags, workload, launch, report, exit status.

Exit status: 0 when nothing was corrupted, every rank agreed (tree digest and
ack counts), no cache leaked and at least one page was verified (or
``--allow-unverified``); 1 when the run failed or a check did not pass; 2 for
bad flags, a bad setting, an unusable output path or a malformed trace,
found before any rank starts. With --compare-upstream (SGLang 0.5.23): the
same for each of its two runs, 0 only when both pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import shlex
import sys
from typing import Any, Callable, Optional, Sequence, Union

from sglang_cp_hicache import settings
from sglang_cp_hicache.sim.config import (
    SGLANG_VERSIONS,
    FailureInjection,
    SimConfig,
    parse_failure_injection,
)
from sglang_cp_hicache.sim.cli_engine import (
    engine_problem,
    resolve_engine,
    run_scheduler_engine,
    scheduler_reserve_tokens,
)
from sglang_cp_hicache.sim.cli_flags import add_simulate_flags
from sglang_cp_hicache.sim.ideal import IdealCache, ideal_cache
from sglang_cp_hicache.sim.l3_writers import object_names, restored_by_writer, write_manifest, writers_of
from sglang_cp_hicache.sim.outputs import OutputPathError, check_output_paths
from sglang_cp_hicache.sim.plot import PlotUnavailable, check_matplotlib, plot_summary
from sglang_cp_hicache.sim.rates import WorkloadFacts
from sglang_cp_hicache.sim.sizing import DEFAULT_CAPACITY, PoolSizing, size_pools
from sglang_cp_hicache.sim.workload import (
    ChatShape,
    SimRequest,
    Trace,
    TraceError,
    load_trace,
    pack_requests,
    synthetic_chat,
)

__all__ = ["add_simulate_parser", "run_simulate", "write_outputs"]

_DEFAULTS = SimConfig()


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        allow_abbrev=False,  # --cp 4 is an error, not --cp-size 4
        help="replay requests on N CP ranks (one process each, gloo) and verify every restored byte",
        description=(
            "Start --cp-size processes joined by a torch.distributed gloo group. Each builds one "
            "CP rank's real SGLang HiCache stack on CPU (0.5.18: DSA device pool, CP allocator, "
            "CpHiRadixCache; 0.5.23: upstream's KV-sharded DSA pool and UnifiedRadixCache, see "
            "--sglang) and replays the same requests through it: by default (--engine scheduler) "
            "SGLang's own Scheduler and event loop batch and chunk them; --engine loop runs one at a "
            "time (match, load-back, alloc, insert, write-through). Each rank writes KV + indexer "
            "content into the pages it owns, and every owned page of every matched prefix is checked "
            "bit-exactly."
        ),
        epilog=(
            "exit status: 0 = nothing corrupted, all ranks agree, no leaks, something verified; 1 = a "
            "check failed or a rank failed; 2 = bad flags, a bad SGLANG_CP_HICACHE_* setting, an unusable "
            "--json/--plot path or a malformed trace (found before any rank starts)."
        ),
    )
    add_simulate_flags(p)
    p.set_defaults(func=run_simulate)
    return p


def installed_sglang() -> str:
    """The SGLang release installed in this environment ("none" without one)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _error(message: str, code: int) -> int:
    print(f"sglang-cp-hicache simulate: error: {message}", file=sys.stderr)
    return code


def _workload(args: argparse.Namespace, config: SimConfig) -> tuple[Sequence[SimRequest], str]:
    if args.trace is not None:
        # pools sized from the trace fit its longest request (sim.sizing); explicit ones are checked
        max_tokens = config.max_request_tokens if args.device_pages is not None else None
        reqs = load_trace(args.trace, seed=config.seed, max_tokens=max_tokens,
                          limit=args.requests, block_tokens=args.trace_block_tokens)
        return reqs, f"trace:{args.trace}"
    if args.trace_block_tokens is not None:
        raise ValueError("--trace-block-tokens needs --trace (a Mooncake trace)")
    if args.capacity is not None:
        raise ValueError("--capacity needs --trace: it sizes the pools from the trace's distinct pages")
    shape = ChatShape()
    first_turn = shape.system_tokens[1] + shape.user_tokens[1]
    usable = config.max_request_tokens
    if usable < first_turn:
        raise ValueError(
            f"--device-pages {config.device_pages} x --cp-size {config.cp_size} leaves {usable} usable "
            f"logical tokens, but the synthetic chat needs {first_turn} per request: raise --device-pages"
        )
    # conversations grow up to half the logical device pool (at least one first turn)
    max_tokens = max(usable // 2, first_turn)
    return synthetic_chat(config.num_requests, seed=config.seed, max_tokens=max_tokens, shape=shape), \
        "synthetic-chat"


@dataclasses.dataclass
class Prepared:
    """What a run needs once every check before the ranks start passed."""

    config: SimConfig
    failure: Optional[FailureInjection]
    requests: Sequence[SimRequest]
    workload: str
    sizing: Optional[PoolSizing] = None  # --trace with pools sized from it
    ideal: Optional[IdealCache] = None  # computed for the sizing (the run reads it against the same)


def run_simulate(args: argparse.Namespace) -> int:
    from sglang_cp_hicache.sim.extensions import isolate_torch_extensions
    from sglang_cp_hicache.sim.launcher import launch
    from sglang_cp_hicache.sim.report import failure_message, summarize
    from sglang_cp_hicache.sim.table import format_table

    isolate_torch_extensions()  # before any rank starts: they inherit it
    prepared = _prepare(args)
    if isinstance(prepared, int):
        return prepared
    config, failure, requests, workload = prepared.config, prepared.failure, prepared.requests, prepared.workload
    token_lists = pack_requests(requests)  # what every rank gets: ids packed, pickled as raw bytes
    facts = WorkloadFacts(
        prompt_tokens=token_lists.total_tokens,
        ideal_hit_tokens=(prepared.ideal or ideal_cache(token_lists, config.page_size)).hit_tokens,
        trace=requests.info.as_dict() if isinstance(requests, Trace) else {},
    )
    if args.compare_upstream:
        return _run_compare_upstream(args, prepared, token_lists, facts)
    if config.fleet_feed is not None:  # one deployment of a fleet: it ends with its coordinator
        from sglang_cp_hicache.testing.lifetime import die_with_launcher

        die_with_launcher(os.getppid())
    if args.engine == "scheduler":
        return run_scheduler_engine(args, prepared, token_lists, facts)

    show = not args.no_progress and config.fleet_feed is None
    l3_before = object_names(config.l3_dir) if config.l3_dir is not None else set()
    cp = launch(config, token_lists, cp_mode=True, failure=failure, show_progress=show)
    if not cp.ok or len(cp.reports) != config.cp_size:
        print(failure_message(cp), file=sys.stderr)
        return 1
    non_cp = None
    if args.compare_non_cp:
        non_cp = launch(config, token_lists, cp_mode=False, show_progress=show)
        if not non_cp.ok or not non_cp.reports:
            print(failure_message(non_cp), file=sys.stderr)
            return 1
    summary, verdict = summarize(config, workload, len(requests), cp, non_cp,
                                 allow_unverified=args.allow_unverified,
                                 facts=facts if config.fleet_feed is None else None)
    summary = {"engine": "loop", **summary}
    if prepared.sizing is not None:
        summary["pool_sizing"] = prepared.sizing.as_dict()
    if config.l3_label is not None and config.fleet_feed is not None:  # what the fleet attributes
        summary["l3_stored_keys_per_rank"] = [r.totals.l3_stored_keys for r in cp.reports]
        summary["l3_restored_keys_per_rank"] = [r.totals.l3_restored_keys for r in cp.reports]
    if config.l3_dir is not None and config.fleet_feed is None:  # a fleet's coordinator attributes its own
        _attribute_l3(summary, config, cp.reports, l3_before)
    print(format_table(summary))
    written = write_outputs(args, summary)
    if written != 0:
        return written
    return 0 if verdict.ok else 1


def _run_compare_upstream(args: argparse.Namespace, prepared: Prepared, token_lists: Any,
                          facts: WorkloadFacts) -> int:
    """--compare-upstream: the library's run (with --l3 if given), then
    upstream's (never with L3), the comparison printed and written."""
    from sglang_cp_hicache.sim.compare import compare_upstream, format_comparison
    from sglang_cp_hicache.sim.launcher import launch
    from sglang_cp_hicache.sim.report import dump_json, failure_message, summarize

    summaries = {}
    for path in ("library", "upstream"):
        config = dataclasses.replace(prepared.config, copy_path=path,
                                     l3_dir=prepared.config.l3_dir if path == "library" else None,
                                     l3_mooncake=prepared.config.l3_mooncake if path == "library" else None)
        l3_before = object_names(config.l3_dir) if config.l3_dir is not None else set()
        run = launch(config, token_lists, cp_mode=True, failure=prepared.failure, show_progress=not args.no_progress)
        if not run.ok or len(run.reports) != config.cp_size:
            print(f"--compare-upstream, the {path} run:", file=sys.stderr)
            print(failure_message(run), file=sys.stderr)
            return 1
        summary, _ = summarize(config, prepared.workload, len(prepared.requests), run, None,
                               allow_unverified=args.allow_unverified, facts=facts)
        if prepared.sizing is not None:
            summary["pool_sizing"] = prepared.sizing.as_dict()
        if config.l3_dir is not None:
            _attribute_l3(summary, config, run.reports, l3_before)
        summaries[path] = summary
    comparison = compare_upstream(summaries["library"], summaries["upstream"], command=_command_line())
    print(format_comparison(comparison))
    if args.json is not None:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(dump_json(comparison))
        except OSError as exc:
            return _error(f"cannot write {exc.filename or 'the output'}: {exc.strerror or exc}", 1)
    return 0 if comparison["ok"] else 1


def _command_line() -> Optional[str]:
    """This run's command as typed (None when not run as the CLI, e.g. from a test)."""
    argv = sys.argv
    if len(argv) < 2 or argv[1] != "simulate" or not argv[0].endswith(("sglang_cp_hicache/__main__.py",
                                                                       "sglang-cp-hicache")):
        return None
    return "python -m sglang_cp_hicache " + shlex.join(argv[1:])


def _attribute_l3(summary: dict[str, Any], config: SimConfig, reports: list, before: set[str]) -> None:
    """Which run wrote the objects the ranks restored from (by release), and
    this run's own manifest for later runs."""
    keys = [k for r in reports for k in r.totals.l3_restored_keys]
    by_writer = restored_by_writer(keys, before, writers_of(config.l3_dir))
    summary["l3_restored_pages_by_writer"] = by_writer
    summary["l3_objects_at_start"] = len(before)  # earlier runs' objects: hits the cold ideal does not count
    summary["l3_restored_from_other_release"] = sum(
        n for writer, n in by_writer.items() if writer in SGLANG_VERSIONS and writer != config.sglang_version
    )
    write_manifest(config.l3_dir, config.sglang_version, object_names(config.l3_dir) - before)


def _prepare(args: argparse.Namespace) -> Union[int, Prepared]:
    """Everything checked before a rank starts: the library's settings
    (each rank would refuse a bad one only after importing SGLang), the
    SGLang release, the flags, the test hook, the output paths and the
    workload; an exit status (2, with the error printed) when one is wrong."""
    try:
        settings.check_all()  # sizes and ratios too: a bad one is one line here, not one per rank later
    except ValueError as exc:
        return _error(str(exc), 2)
    for warning in settings.unknown_names():  # said once here; each rank also logs it at cache build
        print(f"sglang-cp-hicache simulate: warning: {warning}", file=sys.stderr)
    resolve_engine(args)
    version = args.sglang if args.sglang != "auto" else installed_sglang()
    problem = _version_problem(version, args)
    if problem is not None:
        return _error(problem, 2)
    try:
        config = _config(args, version)
        failure: Optional[FailureInjection] = parse_failure_injection()
    except ValueError as exc:
        return _error(str(exc), 2)
    problem = engine_problem(args, version, failure is not None) or _fleet_feed_problem(args)
    if problem is not None:
        return _error(problem, 2)
    if args.plot is not None:
        try:
            check_matplotlib()
        except PlotUnavailable as exc:
            return _error(str(exc), 2)
    try:
        check_output_paths({"--json": args.json, "--plot": args.plot}, inputs={"--trace": args.trace})
    except OutputPathError as exc:
        return _error(str(exc), 2)
    try:
        requests, workload = _workload(args, config)
        ideal = ideal_cache(requests.packed, config.page_size) if isinstance(requests, Trace) else None
        sizing = _trace_pools(args, config, requests, ideal)
        if sizing is not None:
            config = dataclasses.replace(config, device_pages=sizing.device_pages, host_pages=sizing.host_pages)
    except (TraceError, ValueError) as exc:
        return _error(str(exc), 2)
    problem = _l3_problem(config.l3_dir) or _mooncake_problem(config)  # last: only a run that will start creates DIR
    if problem is not None:
        return _error(problem, 2)
    return Prepared(config, failure, requests, workload, sizing, ideal)


def _trace_pools(args: argparse.Namespace, config: SimConfig, requests: Sequence[SimRequest],
                 ideal: Optional[IdealCache]) -> Optional[PoolSizing]:
    """--trace without both pool sizes: the pools from the trace's working
    set (:mod:`.sizing`); None otherwise."""
    if not isinstance(requests, Trace) or ideal is None or (
            args.device_pages is not None and args.host_pages is not None):
        return None
    packed = requests.packed
    return size_pools(
        distinct_pages=ideal.distinct_pages,
        longest_request_tokens=max(packed.request_len(i) for i in range(len(packed))),
        cp_size=config.cp_size, page_size=config.page_size,
        capacity=args.capacity if args.capacity is not None else DEFAULT_CAPACITY,
        device_pages=args.device_pages, host_pages=args.host_pages,
        reserve_tokens=(scheduler_reserve_tokens(args.max_new_tokens, config.cp_size, config.page_size)
                        if args.engine == "scheduler" else 0),
    )


def _l3_problem(directory: Optional[str]) -> Optional[str]:
    """Why --l3's directory is unusable (None if it is, or there is none):
    created if missing and proven writable, as each rank's cache will."""
    if directory is None:
        return None
    from sglang_cp_hicache.l3.store import FilePageStore

    try:
        FilePageStore(directory)
    except (TypeError, ValueError) as exc:
        return f"--l3 {directory}: not a usable L3 directory: {exc}"
    return None


def _l3_fields(args: argparse.Namespace) -> dict[str, Any]:
    """SimConfig's L3 fields from --l3 and --mooncake-segment (ValueError naming the flag)."""
    from sglang_cp_hicache.sim.mooncake_l3 import MOONCAKE_SCHEME, parse_master, parse_segment

    if args.l3 is None or not args.l3.startswith(MOONCAKE_SCHEME):
        if args.mooncake_segment is not None:
            raise ValueError("--mooncake-segment needs --l3 mooncake://HOST:PORT")
        return {"l3_dir": os.path.abspath(args.l3) if args.l3 is not None else None}
    fields: dict[str, Any] = {"l3_mooncake": parse_master(args.l3)}
    if args.mooncake_segment is not None:
        fields["mooncake_segment_bytes"] = parse_segment(args.mooncake_segment)
    return fields


def _mooncake_problem(config: SimConfig) -> Optional[str]:
    """Why this environment cannot open the Mooncake L3 --l3 names (None if it can, or there is none)."""
    if config.l3_mooncake is None:
        return None
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return (f"--l3 mooncake://{config.l3_mooncake}: this environment ({sys.executable}) has no mooncake "
                "wheel (mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA)")
    return None


def _fleet_feed_problem(args: argparse.Namespace) -> Optional[str]:
    """Why a fleet deployment (--fleet-feed) cannot run with these flags."""
    if args.fleet_feed is None:
        return None
    if not os.path.isdir(args.fleet_feed):
        return f"--fleet-feed {args.fleet_feed}: not a directory"
    for flag, given in (("--compare-non-cp", args.compare_non_cp),
                        ("--compare-upstream", args.compare_upstream), ("--plot", args.plot is not None)):
        if given:
            return f"--fleet-feed (a fleet deployment) and {flag} do not combine"
    return None


def _version_problem(version: str, args: argparse.Namespace) -> Optional[str]:
    if version not in SGLANG_VERSIONS:
        return f"the installed SGLang is {version}; the simulator drives {' and '.join(SGLANG_VERSIONS)}"
    problem = _compare_upstream_problem(version, args)
    if problem is not None:
        return problem
    if version == "0.5.23" and args.l3 is not None and args.copy != "library":  # a flag conflict
        return ("--l3 needs --copy library on --sglang 0.5.23: upstream's sharded stack refuses storage "
                "under KV sharding")
    if version != installed_sglang():
        return (f"--sglang {version}, but this environment has SGLang {installed_sglang()} "
                "(0.5.18 and 0.5.23 live in separate venvs: .venv and .venv-0523)")
    return None


def _compare_upstream_problem(version: str, args: argparse.Namespace) -> Optional[str]:
    """Why --compare-upstream cannot run with these flags (None if it can)."""
    if not args.compare_upstream:
        return None
    if version != "0.5.23":
        return (f"--compare-upstream needs SGLang 0.5.23 (this is {version}): only 0.5.23 has upstream's own "
                "KV-sharded stack to compare with; 0.5.18's CP copies are this library's")
    if args.copy != "library":
        return "--compare-upstream runs both copy paths itself: leave out --copy"
    for flag, given in (("--compare-non-cp", args.compare_non_cp), ("--plot", args.plot is not None)):
        if given:
            return f"--compare-upstream and {flag} do not combine: run them separately"
    return None


def _config(args: argparse.Namespace, version: str) -> SimConfig:
    return SimConfig(
        cp_size=args.cp_size, page_size=args.page_size, num_layers=args.layers,
        num_requests=args.requests if args.requests is not None else _DEFAULTS.num_requests,
        seed=args.seed,
        # None: the defaults, or (--trace) sized from the trace once it is read
        device_pages=args.device_pages if args.device_pages is not None else _DEFAULTS.device_pages,
        host_pages=args.host_pages if args.host_pages is not None else _DEFAULTS.host_pages,
        collective_timeout_s=args.collective_timeout,
        non_cp_group=args.non_cp_group,
        grace_s=min(_DEFAULTS.grace_s, args.collective_timeout),
        startup_timeout_s=args.startup_timeout,
        sglang_version=version, copy_path=args.copy,
        **_l3_fields(args),
        metrics=args.metrics,
        fleet_feed=os.path.abspath(args.fleet_feed) if args.fleet_feed is not None else None,
    )


def write_outputs(args: argparse.Namespace, summary: dict[str, Any],
                  plot: Callable[[dict[str, Any], str], None] = plot_summary, command: str = "simulate") -> int:
    """--json and --plot (drawn by ``plot``); 1 (with the error printed, as
    ``command``'s) when the disk refuses, 0 otherwise. The paths were checked
    before the run; the disk may still fill up since."""
    from sglang_cp_hicache.sim.report import dump_json

    try:
        if args.json is not None:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(dump_json(summary))
        if args.plot is not None:
            plot(summary, args.plot)
    except OSError as exc:
        print(f"sglang-cp-hicache {command}: error: cannot write {exc.filename or 'the output'}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
