"""``simulate``'s flags: the argument types (each error names its flag and
what it got) and the flag groups (deployment and workload, outputs, limits,
the SGLang stack). :mod:`.cli` builds the subcommand from them and runs it."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from sglang_cp_hicache.sim.config import (
    COPY_PATHS,
    DSA_PAGE_SIZE,
    NON_CP_GROUPS,
    SGLANG_VERSIONS,
    SimConfig,
    default_startup_timeout_s,
    seconds_problem,
)
from sglang_cp_hicache.sim.mooncake import DEFAULT_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS
from sglang_cp_hicache.sim.sizing import DEFAULT_CAPACITY

__all__ = ["DEFAULT_ENGINE", "ENGINES", "SCHEDULER_ONLY_FLAGS", "add_simulate_flags"]

ENGINES = ("loop", "scheduler")
#: The engine of a run that names none (the loop engine was the default before the scheduler's held).
DEFAULT_ENGINE = "scheduler"
#: The flags only --engine scheduler reads: (flag, argparse dest).
SCHEDULER_ONLY_FLAGS = (("--max-running-requests", "max_running_requests"),
                        ("--chunked-prefill-size", "chunked_prefill_size"), ("--in-flight", "in_flight"),
                        ("--max-new-tokens", "max_new_tokens"), ("--overlap", "overlap"))

_DEFAULTS = SimConfig()


def add_simulate_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``simulate``, in the order ``--help`` lists them."""
    _add_shape_flags(p)
    _add_output_flags(p)
    _add_limit_flags(p)
    _add_stack_flags(p)
    _add_engine_flags(p)


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
    p.add_argument("--l3", metavar="DIR|mooncake://HOST:PORT", default=None,
                   help="give the CP ranks this library's L3 tier (0.5.23: --copy library): a file store in DIR "
                        "(created if missing; SGLANG_CP_HICACHE_L3_DIR in each rank), or a Mooncake store on the "
                        "running mooncake_master at HOST:PORT (--hicache-storage-backend mooncake in each rank: "
                        "its own client over TCP lending --mooncake-segment; needs the mooncake wheel). Pages "
                        "are keyed by content, so runs of any --cp-size share it: each rank writes the pages it "
                        "owns once their write-through completes, and every request first looks its uncached "
                        "pages up in L3. With --compare-non-cp the non-CP baseline runs without L3")
    p.add_argument("--mooncake-segment", metavar="SIZE", default=None,
                   help="--l3 mooncake://...: the memory each CP rank's client lends the store (its segment; "
                        "'64mb', '1gb' or bytes, at least 16mb; default 64mb)")
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
    # a fleet's coordinator (sim.fleet) starts each deployment with the pipes it feeds requests through
    p.add_argument("--fleet-feed", metavar="DIR", default=None, help=argparse.SUPPRESS)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Which engine replays the workload, and the real scheduler's knobs."""
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="'scheduler': SGLang's real Scheduler and its own event loop in each CP rank, only the "
                        "model worker replaced (batches, chunked prefill, PrefillAdder's quotas, load-backs it "
                        "asks for, its idle leak checks); arrivals are a closed loop in the workload's order, at "
                        "most --in-flight unfinished; 'loop': the simulator's own loop (one request at a time: "
                        "match, load-back, alloc, insert), the one that takes --compare-non-cp, "
                        f"--compare-upstream, --plot, --metrics and --l3 mooncake:// (default {DEFAULT_ENGINE})")
    p.add_argument("--max-running-requests", type=_positive("--max-running-requests", 1024), default=None,
                   metavar="N", help="--engine scheduler: SGLang's --max-running-requests (default 8)")
    p.add_argument("--chunked-prefill-size", type=_positive("--chunked-prefill-size"), default=None,
                   metavar="T", help="--engine scheduler: SGLang's --chunked-prefill-size, a multiple of the "
                                     "page size (default 1024)")
    p.add_argument("--in-flight", type=_positive("--in-flight", 4096), default=None, metavar="K",
                   help="--engine scheduler: requests submitted and unfinished at most; the next one in order "
                        "is submitted before the next batch once one finishes (default: --max-running-requests)")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens", 4096), default=None, metavar="M",
                   help="--engine scheduler on 0.5.18 or CP 1: tokens each request decodes (default 1: prefill "
                        "only, as the loop engine; more puts decode and retraction in the run)")
    p.add_argument("--overlap", action="store_true",
                   help="--engine scheduler: SGLang's overlap event loop instead of the normal one")
