"""``simulate --engine``: which flags each engine honours, and the scheduler
engine's run (:mod:`.engine_scheduler`) from the prepared workload to the
exit status (0 passed, 1 a rank failed or a check did not pass)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from sglang_cp_hicache.sim.cli_flags import DEFAULT_ENGINE, SCHEDULER_ONLY_FLAGS
from sglang_cp_hicache.sim.config import FAIL_ENV
from sglang_cp_hicache.sim.engine_scheduler import EngineOptions
from sglang_cp_hicache.sim.rates import WorkloadFacts

__all__ = ["engine_options", "engine_problem", "resolve_engine", "run_scheduler_engine", "scheduler_reserve_tokens"]

#: Flags the scheduler engine cannot honour, and why.
_REFUSED = (
    ("--compare-non-cp", "compare_non_cp", "the non-CP baseline runs on the loop engine only"),
    ("--compare-upstream", "compare_upstream", "run --copy library and --copy upstream as two runs"),
    ("--plot", "plot", "its per-request series come from the loop engine"),
    ("--metrics", "metrics", "the ranks' library metrics are scraped by the loop engine only"),
    ("--startup-timeout", "startup_timeout", "the scheduler harness has its own start-up limit (240 s)"),
)


def resolve_engine(args: argparse.Namespace) -> None:
    """``args.engine`` set (the default where none was named); ``args.engine_named`` says whether one was."""
    args.engine_named = args.engine is not None
    if args.engine is None:
        args.engine = DEFAULT_ENGINE


def engine_problem(args: argparse.Namespace, version: str, failure_injected: bool) -> Optional[str]:
    """Why the flags do not fit ``--engine`` (None if they do), naming the flag; where the
    scheduler engine came by default, how to get the loop engine."""
    problem = _engine_problem(args, version, failure_injected)
    if problem is not None and args.engine == "scheduler" and not getattr(args, "engine_named", True):
        problem += f" (the default engine is {DEFAULT_ENGINE}: add --engine loop for the simulator's own loop)"
    return problem


def _engine_problem(args: argparse.Namespace, version: str, failure_injected: bool) -> Optional[str]:
    if args.engine == "loop":
        for flag, dest in SCHEDULER_ONLY_FLAGS:
            if getattr(args, dest) not in (None, False):
                return f"{flag} needs --engine scheduler (the loop engine replays one request at a time)"
        return None
    for flag, dest, why in _REFUSED:
        if getattr(args, dest) not in (None, False):
            return f"--engine scheduler does not take {flag}: {why}"
    if failure_injected:
        return f"--engine scheduler does not take {FAIL_ENV}: failure injection is the loop engine's"
    problem = _l3_problem(args)
    if problem is not None:
        return problem
    if version == "0.5.23" and args.cp_size > 1 and (args.max_new_tokens or 1) > 1:
        return ("--max-new-tokens must be 1 on SGLang 0.5.23 at --cp-size > 1: its sharded allocator refuses "
                "decode, so the ranks run as a PD prefill server")
    chunk = args.chunked_prefill_size
    if chunk is not None and chunk % args.page_size:
        return f"--chunked-prefill-size must be a multiple of the page size {args.page_size}, got {chunk}"
    return None


def _l3_problem(args: argparse.Namespace) -> Optional[str]:
    """Why the scheduler engine cannot serve this --l3 (None if it can)."""
    from sglang_cp_hicache.sim.mooncake_l3 import MOONCAKE_SCHEME

    if args.l3 is None:
        return None
    if args.l3.startswith(MOONCAKE_SCHEME):
        return (f"--engine scheduler takes --l3 DIR only, got {args.l3}: its L3 is SGLang's file storage backend "
                "(run --l3 mooncake://... with --engine loop)")
    if args.cp_size < 2:
        return ("--engine scheduler with --l3 needs --cp-size >= 2: at CP 1 SGLang builds its own cache and "
                "storage backend, not this library's")
    return None


def scheduler_reserve_tokens(max_new_tokens: Optional[int], cp_size: int, page_size: int) -> int:
    """Device tokens a request needs under SGLang's scheduler beside its prompt. ``PrefillAdder`` admits
    a request only while more tokens are free than its prompt, its new tokens and a per-request overhead
    (0.5.18: one page; 0.5.23 under CP: one page on every rank) together."""
    return (max_new_tokens or EngineOptions().max_new_tokens) + cp_size * page_size + 1


def pool_problem(config: Any, longest_request: int, opts: EngineOptions) -> Optional[str]:
    """Why the device pool can never admit the longest request (None if it can): SGLang would wait for it
    forever."""
    from sglang_cp_hicache.sim.sizing import pages_for_request

    need = pages_for_request(
        longest_request + scheduler_reserve_tokens(opts.max_new_tokens, config.cp_size, config.page_size),
        config.cp_size, config.page_size)
    if config.device_pages >= need:
        return None
    return (f"--device-pages {config.device_pages} is too small for --engine scheduler: the longest request "
            f"({longest_request} tokens, {opts.max_new_tokens} new) needs {need} device pages per rank at "
            f"--cp-size {config.cp_size}; SGLang's scheduler would never admit it")


def engine_options(args: argparse.Namespace, l3_dir: Optional[str] = None) -> EngineOptions:
    """The scheduler engine's options from the flags; ``l3_dir``: --l3's directory, made absolute."""
    defaults = EngineOptions()
    return EngineOptions(
        max_running_requests=args.max_running_requests or defaults.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size or defaults.chunked_prefill_size,
        in_flight=args.in_flight, max_new_tokens=args.max_new_tokens or defaults.max_new_tokens,
        overlap=bool(args.overlap), l3_dir=l3_dir)


def run_scheduler_engine(args: argparse.Namespace, prepared: Any, token_lists: Any, facts: WorkloadFacts) -> int:
    """Replay through the real scheduler, print and write the summary."""
    from sglang_cp_hicache.sim.engine_scheduler import replay_through_scheduler
    from sglang_cp_hicache.sim.engine_scheduler_fed import fed_loop
    from sglang_cp_hicache.sim.l3_writers import object_names, write_manifest
    from sglang_cp_hicache.sim.report import dump_json
    from sglang_cp_hicache.sim.report_scheduler import format_scheduler_table, summarize_scheduler
    from sglang_cp_hicache.testing.sched_harness import HarnessError

    l3_dir = prepared.config.l3_dir
    opts = engine_options(args, l3_dir)
    problem = pool_problem(prepared.config, max((token_lists.request_len(i) for i in range(len(token_lists))),
                                                default=1), opts)
    if problem is not None:
        print(f"sglang-cp-hicache simulate: error: {problem}", file=sys.stderr)
        return 2
    fleet = prepared.config.fleet_feed is not None  # a fleet's coordinator attributes the shared store's pages
    l3_before = object_names(l3_dir) if l3_dir is not None and not fleet else set()
    try:
        make_loop = None if not fleet else fed_loop(prepared.config.fleet_feed, prepared.config.page_size)
        replay = replay_through_scheduler(prepared.config, token_lists, opts, show_progress=not args.no_progress,
                                          make_loop=make_loop)
    except HarnessError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    summary = summarize_scheduler(prepared.config, opts, prepared.workload, replay, facts,
                                  allow_unverified=args.allow_unverified)
    if l3_dir is not None and fleet:  # what the fleet attributes
        summary["l3_stored_keys_per_rank"] = [r.l3_stored_keys for r in replay.run.ranks]
        summary["l3_restored_keys_per_rank"] = [r.l3_restored_keys for r in replay.run.ranks]
    elif l3_dir is not None:
        added = object_names(l3_dir) - l3_before
        # earlier runs' objects give hits the cold ideal does not count; the manifest names this run's
        # objects for later loop-engine runs' attribution by writer
        summary["l3_objects_at_start"], summary["l3_objects_added"] = len(l3_before), len(added)
        write_manifest(l3_dir, prepared.config.sglang_version, added)
    if prepared.sizing is not None:
        summary["pool_sizing"] = prepared.sizing.as_dict()
    print(format_scheduler_table(summary))
    if args.json is not None:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(dump_json(summary))
        except OSError as exc:
            print(f"sglang-cp-hicache simulate: error: cannot write {exc.filename or 'the output'}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0 if summary["ok"] else 1
