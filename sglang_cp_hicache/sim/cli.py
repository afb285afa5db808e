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
    COPY_PATHS,
    DSA_PAGE_SIZE,
    NON_CP_GROUPS,
    SGLANG_VERSIONS,
    FailureInjection,
    SimConfig,
    default_startup_timeout_s,
    parse_failure_injection,
    seconds_problem,
)
from sglang_cp_hicache.sim.ideal import IdealCache, ideal_cache
from sglang_cp_hicache.sim.l3_writers import object_names, restored_by_writer, write_manifest, writers_of
from sglang_cp_hicache.sim.mooncake import DEFAULT_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS
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

__all__ = ["add_simulate_parser", "run_simulate"]

_DEFAULTS = SimConfig()


def _converted(text: str, convert: Callable[[str], Any], expected: str) -> Any:
    """``convert(text)``, or the argparse error "``expected``, got ``text``"."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None


def _positive(name: str, upper: Optional[int] = None):
    def parse(text: str) -> int:
        value = _converted(text, int, f"{name} must be an integer")
        if value < 1 or (upper is not None and value > upper):
            bound = f" in [1, {upper}]" if upper is not None else " >= 1"
            raise argparse.ArgumentTypeError(f"{name} must be an integer{bound}, got {value}")
        return value

    return parse


def _page_size(text: str) -> int:
    value = _converted(text, int, "must be an integer")
    if value != DSA_PAGE_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value} is not supported: SGLang 0.5.18's DSATokenToKVPool requires page size "
            f"{DSA_PAGE_SIZE} outside ROCm"
        )
    return value


def _seconds(text: str) -> float:
    value = _converted(text, float, "must be a number of seconds")
    problem = seconds_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def _fraction(text: str) -> float:
    value = _converted(text, float, "must be a number")
    if not 0 < value <= 64:  # nan fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 64], got {text}")
    return value


def _seed(text: str) -> int:
    value = _converted(text, int, "must be an integer")
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**31), got {value}")
    return value


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        allow_abbrev=False,  # --cp 4 is an error, not --cp-size 4
        help="replay requests on N CP ranks (one process each, gloo) and verify every restored byte",
        description=(
            "Start --cp-size processes joined by a torch.distributed gloo group. Each builds one "
            "CP rank's real SGLang HiCache stack on CPU (0.5.18: DSA device pool, CP allocator, "
            "CpHiRadixCache; 0.5.23: upstream's KV-sharded DSA pool and UnifiedRadixCache, see "
            "--sglang) and replays the same requests: match, load-back, alloc, "
            "write KV + indexer content into the pages it owns, insert, write-through. Every owned "
            "page of every matched prefix is checked bit-exactly."
        ),
        epilog=(
            "exit status: 0 = nothing corrupted, all ranks agree, no leaks, something verified; 1 = a "
            "check failed or a rank failed; 2 = bad flags, a bad SGLANG_CP_HICACHE_* setting, an unusable "
            "--json/--plot path or a malformed trace (found before any rank starts)."
        ),
    )
    _add_shape_flags(p)
    _add_output_flags(p)
    _add_limit_flags(p)
    _add_stack_flags(p)
    p.set_defaults(func=run_simulate)
    return p


def _add_shape_flags(p: argparse.ArgumentParser) -> None:
    """The simulated deployment and its workload."""
    p.add_argument("--cp-size", type=_positive("--cp-size", 64), default=_DEFAULTS.cp_size,
                   metavar="N", help=f"CP ranks, one process each (default {_DEFAULTS.cp_size})")
    p.add_argument("--page-size", type=_page_size, default=_DEFAULTS.page_size,
                   metavar="P", help="tokens per KV page; SGLang's DSA pool takes only 64 (default 64)")
    p.add_argument("--layers", type=_positive("--layers", 64), default=_DEFAULTS.num_layers,
                   metavar="L", help=f"KV (and indexer) layers per pool (default {_DEFAULTS.num_layers})")
    p.add_argument("--requests", type=_positive("--requests"), default=None, metavar="R",
                   help=f"requests to replay (synthetic default {_DEFAULTS.num_requests}; "
                        "with --trace: the first R lines, default all)")
    p.add_argument("--seed", type=_seed, default=_DEFAULTS.seed, metavar="S",
                   help=f"workload and content seed (default {_DEFAULTS.seed})")
    p.add_argument("--device-pages", type=_positive("--device-pages"), default=None,
                   metavar="D", help="device KV pages per rank; the shared logical pool has N*D, page 0 "
                                     f"being padding (default {_DEFAULTS.device_pages}; with --trace: "
                                     "from --capacity)")
    p.add_argument("--host-pages", type=_positive("--host-pages"), default=None,
                   metavar="H", help=f"host KV pages per rank (default {_DEFAULTS.host_pages}; with --trace: "
                                     "from --capacity)")
    p.add_argument("--capacity", type=_fraction, default=None, metavar="F",
                   help="with --trace, unless --device-pages / --host-pages say otherwise: size the pools from "
                        "U, the distinct whole pages of the requests replayed (one per distinct prefix): host "
                        "pages per rank H = ceil(F*U/N), device pages per rank ceil(H/2) but at least enough "
                        f"for the longest request; each at least 4 (default {DEFAULT_CAPACITY:g}: the N host "
                        "pools together hold a quarter of the working set)")
    p.add_argument("--trace", metavar="FILE.jsonl", default=None,
                   help='replay a trace: one {"tokens": [...]} or {"prompt_len": n, "prefix_group": g'
                        ', "shared_len": s} per line, or a Mooncake FAST\'25 trace ({"timestamp": ms, '
                        '"input_length": n, "hash_ids": [...]} per line; detected from the first line)')
    p.add_argument("--trace-block-tokens", type=_positive("--trace-block-tokens", MOONCAKE_BLOCK_TOKENS),
                   default=None, metavar="B",
                   help=f"Mooncake trace: tokens per hash id (its blocks are {MOONCAKE_BLOCK_TOKENS} tokens; "
                        f"default {DEFAULT_BLOCK_TOKENS}, one page: the sharing structure at "
                        f"{DEFAULT_BLOCK_TOKENS}/{MOONCAKE_BLOCK_TOKENS} of the length; "
                        f"{MOONCAKE_BLOCK_TOKENS} replays the real lengths)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What gets written, and the non-CP run to compare with."""
    p.add_argument("--json", metavar="PATH", default=None, help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write a PNG: host pages the ranks hold against the logical pool and non-CP, each "
                        "rank's share against 1/N, hits per tier over the run against the ideal (needs matplotlib)")
    p.add_argument("--compare-non-cp", action="store_true",
                   help="also replay through a plain (non-sharded) stack of the same release with the same "
                        "logical capacity (device pages D*N, host pages H*N) and compare hits "
                        "(capacity_efficiency), host slots, CPU and all-reduces")
    p.add_argument("--non-cp-group", choices=NON_CP_GROUPS, default=_DEFAULTS.non_cp_group,
                   help="the non-CP baseline: 'tp' runs N processes on one gloo group, each with the whole "
                        "pool (a TP deployment of an MLA model: replicated KV, the same per-step ack "
                        "all-reduce over N ranks); 'single' runs one process with no group "
                        f"(default {_DEFAULTS.non_cp_group})")
    p.add_argument("--l3", metavar="DIR", default=None,
                   help="give the CP ranks this library's file L3 tier in DIR (0.5.23: --copy library; created "
                        "if missing; SGLANG_CP_HICACHE_L3_DIR in each rank). Pages are keyed by content, so "
                        "runs of any --cp-size share DIR: each rank writes the pages it owns once their "
                        "write-through completes, and every request first looks its uncached pages up in "
                        "L3. With --compare-non-cp the non-CP baseline runs without L3")
    p.add_argument("--compare-upstream", action="store_true",
                   help="SGLang 0.5.23 only: replay the workload twice, through this library's path (--copy "
                        "library) and upstream's (--copy upstream), and report them side by side (hits per "
                        "tier against the ideal, backups lost, host reads of device indices, costs); with "
                        "--l3 only the library's run has the L3 tier (upstream refuses storage under KV "
                        "sharding). --json writes the comparison with both summaries")
    p.add_argument("--metrics", action="store_true",
                   help="build the CP ranks' caches as --enable-metrics does and put each rank's scrape of the "
                        "library's metrics (sglang_cp_hicache:*, docs/metrics.md) in the summary "
                        "(library_metrics_per_rank)")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Timeouts, and whether a run that verified nothing passes."""
    p.add_argument("--collective-timeout", type=_seconds, default=_DEFAULTS.collective_timeout_s,
                   metavar="SECONDS", help="gloo timeout once every rank is up: a rank that waits longer for "
                                           "its peers fails (startup: import, rendezvous and stack build, "
                                           "see --startup-timeout) (default "
                                           f"{_DEFAULTS.collective_timeout_s:g}; at most one day)")
    p.add_argument("--startup-timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="how long the ranks get to import SGLang, meet and build their stacks (default "
                        f"120 + 30 per rank: {default_startup_timeout_s(2):g} s at --cp-size 2, "
                        f"{default_startup_timeout_s(8):g} s at 8; at most one day)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="exit 0 even if no page was verified (e.g. a trace of requests shorter than a "
                        "page); without it such a run fails, since it proved nothing")


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    """Which SGLang stack and copy path, and the progress bar."""
    p.add_argument("--sglang", choices=("auto", *SGLANG_VERSIONS), default="auto",
                   help="which SGLang's stack the ranks build: 0.5.18 (HiRadixCache + this library's CP "
                        "cache) or 0.5.23 (upstream's KV-sharded UnifiedRadixCache); auto: the installed "
                        "one (default auto)")
    p.add_argument("--copy", choices=COPY_PATHS, default="library",
                   help="SGLang 0.5.23 only: whose copies the sharded pool runs, this library's kernels or "
                        "upstream's own (default library)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


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
    from sglang_cp_hicache.sim.launcher import launch
    from sglang_cp_hicache.sim.report import failure_message, summarize
    from sglang_cp_hicache.sim.table import format_table

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

    show = not args.no_progress
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
                                 allow_unverified=args.allow_unverified, facts=facts)
    if prepared.sizing is not None:
        summary["pool_sizing"] = prepared.sizing.as_dict()
    if config.l3_dir is not None:
        _attribute_l3(summary, config, cp.reports, l3_before)
    print(format_table(summary))
    written = _write_outputs(args, summary)
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
                                     l3_dir=prepared.config.l3_dir if path == "library" else None)
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
    version = args.sglang if args.sglang != "auto" else installed_sglang()
    problem = _version_problem(version, args)
    if problem is not None:
        return _error(problem, 2)
    try:
        config = _config(args, version)
        failure: Optional[FailureInjection] = parse_failure_injection()
    except ValueError as exc:
        return _error(str(exc), 2)
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
    problem = _l3_problem(config.l3_dir)  # last: only a run that will start creates DIR
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
        l3_dir=os.path.abspath(args.l3) if args.l3 is not None else None,
        metrics=args.metrics,
    )


def _write_outputs(args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """--json and --plot; 1 (with the error printed) when the disk refuses,
    0 otherwise. The paths were checked before the run; the disk may still
    fill up since."""
    from sglang_cp_hicache.sim.report import dump_json

    try:
        if args.json is not None:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(dump_json(summary))
        if args.plot is not None:
            plot_summary(summary, args.plot)
    except OSError as exc:
        return _error(f"cannot write {exc.filename or 'the output'}: {exc.strerror or exc}", 1)
    return 0
