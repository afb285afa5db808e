"""Turn rank reports into the summary (JSON) and the verdict; the failure
message of a run that did not finish. The table printed from the summary is
:mod:`.table`.

Definitions used in the comparison with the non-CP run:

* host slots: physical host KV slots in use (tokens), sampled after every
  request; a rank's *peak* is the maximum over the run. The goal of
  0.5.18's exact host balance is ``peak(rank) <= peak(non-CP) / N +
  page_size`` for every rank (none on 0.5.23: upstream's tree picks host
  evictions).
* CPU seconds: process CPU time (``time.process_time``: user + system of the
  whole process, gloo threads included) of the request replay only -- after
  ``import sglang``, the process group and the stack build, which both runs
  pay alike and which are reported separately as ``startup_seconds``. The CP
  figure is the mean over ranks; the goal is ``mean(CP) / non-CP <= 1.10``.
  Goals are targets the report states, not checks: only the checks (no
  corruption, ranks agree, no leak, something verified) decide ``ok``.
  ``cache_cpu_seconds`` is the part spent inside SGLang cache and allocator
  calls (match, load-back, insert, evict, checks, their all-reduces), and
  ``content_cpu_seconds`` the part spent writing and verifying KV bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.failures import describe_exit, first_cause, later_failures
from sglang_cp_hicache.sim.launcher import LaunchResult, log_name
from sglang_cp_hicache.sim.rates import WorkloadFacts, capacity_fields, hit_fields, traffic_fields
from sglang_cp_hicache.sim.records import AFTER_REPLAY, AckCounts, RankReport

__all__ = [
    "CACHE_CPU_GOAL",
    "CPU_GOAL",
    "NOTHING_VERIFIED",
    "Verdict",
    "dump_json",
    "failure_message",
    "mean",
    "summarize",
]

CPU_GOAL = 1.10
CACHE_CPU_GOAL = 1.10  # the cache calls alone, same comparison
#: Why a run can verify nothing: verification checks owned pages of matched
#: prefixes, and only whole pages are cached.
NOTHING_VERIFIED = (
    "no page was verified: no request matched a cached prefix of at least one whole page "
    "(requests shorter than a page, or no shared prefixes)"
)


@dataclass
class Verdict:
    ok: bool
    problems: list[str] = field(default_factory=list)


def mean(values: list[float]) -> float:
    """The arithmetic mean (0.0 of nothing)."""
    return sum(values) / len(values) if values else 0.0


def _side(report: RankReport) -> dict[str, Any]:
    recs = report.records
    t = report.totals
    return {
        "verified_pages": sum(r.verified_pages for r in recs),
        "restored_pages_verified": sum(r.restored_pages_verified for r in recs),
        "corrupted_pages": sum(r.corrupted_pages for r in recs),
        "host_slots": report.peak_host_slots,
        "host_slot_capacity": t.host_slot_capacity,
        "backup_tokens": t.backup_tokens,
        "backup_slots": t.backup_slots,
        "load_back_tokens": t.load_back_tokens,
        "load_backs": t.load_backs,
        "host_evicted_slots": t.host_evicted_slots,
        "device_evicted_tokens": sum(r.device_tokens_evicted for r in recs),
        "device_reclaimed_tokens": sum(r.device_tokens_reclaimed for r in recs),
        "device_hit_tokens": sum(r.device_hit_tokens for r in recs),
        "host_hit_tokens": sum(r.host_hit_tokens for r in recs),
        "skipped_requests": sum(r.skipped for r in recs),
        "load_backs_refused": sum(r.host_hit_tokens > 0 and r.loaded_tokens == 0 for r in recs),
        "cpu_seconds": report.cpu_seconds,
        "cache_cpu_seconds": report.cache_cpu_seconds,
        "content_cpu_seconds": report.content_cpu_seconds,
        "collective_cpu_seconds": report.collective_cpu_seconds,
        "collective_calls": report.collective_calls,
        "wall_seconds": report.wall_seconds,
        "startup_seconds": report.startup_seconds,
        "invariant_violations": list(t.invariant_violations),
    }


def summarize(
    config: SimConfig,
    workload: str,
    num_requests: int,
    cp: LaunchResult,
    non_cp: Optional[LaunchResult],
    *,
    allow_unverified: bool = False,
    facts: Optional[WorkloadFacts] = None,
) -> tuple[dict[str, Any], Verdict]:
    """The JSON summary and whether the run passed. Only call with every
    rank's report present (``cp.ok``). A run that verified no page at all
    proves nothing, so it fails unless ``allow_unverified``. ``facts``: the
    prompt tokens and the ideal (:mod:`.rates`; without them, computed
    from nothing: no ideal)."""
    reports = cp.reports
    sides = [_side(r) for r in reports]
    rank0 = next(r for r in reports if r.rank == 0)
    if facts is None:
        facts = WorkloadFacts(prompt_tokens=sum(rec.tokens for rec in rank0.records),
                              ideal_hit_tokens=[0] * len(rank0.records))
    summary: dict[str, Any] = {
        **_run_fields(config, workload, num_requests),
        **hit_fields(facts, rank0),
        "l3_hit_tokens": 0,  # without --l3 (replaced by the L3 fields below)
        **_timing_fields(cp),
        **_verified_fields(sides),
        **_cache_fields(reports, sides, rank0),
        **_agreement_fields(reports, rank0),
        **_cpu_fields(reports),
        **_copy_fields(reports),
        **(_bookkeeping_fields(reports, rank0) if config.sglang_version == "0.5.23" else {}),
        **(_l3_fields(config, reports) if config.l3_label is not None else {}),
        **traffic_fields(reports, config.page_size),
        **({"library_metrics_per_rank": [r.metrics for r in reports]} if config.metrics else {}),
        "series": {
            "host_slots_per_rank": [[rec.host_slots for rec in r.records] for r in reports],
            "device_hit_tokens": [rec.device_hit_tokens for rec in rank0.records],
            "host_hit_tokens": [rec.host_hit_tokens for rec in rank0.records],
            "loaded_tokens": [rec.loaded_tokens for rec in rank0.records],
            "l3_hit_tokens": [rec.l3_hit_tokens for rec in rank0.records],
            "ideal_hit_tokens": list(facts.ideal_hit_tokens),
            "request_index": [rec.index for rec in rank0.records],
        },
    }
    problems = _cp_problems(summary, reports, allow_unverified)
    if non_cp is not None and non_cp.reports:
        problems += _add_non_cp(summary, config, num_requests, cp, non_cp)
    summary["ok"] = not problems
    summary["problems"] = problems
    return summary, Verdict(ok=not problems, problems=problems)


def _timing_fields(cp: LaunchResult) -> dict[str, Any]:
    """Start-up (spawn to the last stack built, as the launcher saw it) apart
    from the replay (the slowest rank's, after its stack was built)."""
    return {
        "startup_wall_seconds": cp.startup_seconds,
        "replay_wall_seconds": max(r.wall_seconds for r in cp.reports),
        "run_wall_seconds": cp.wall_seconds,
    }


def _run_fields(config: SimConfig, workload: str, num_requests: int) -> dict[str, Any]:
    return {
        "sglang_version": config.sglang_version,
        "copy_path": config.copy_path,
        "cp_size": config.cp_size,
        "page_size": config.page_size,
        "layers": config.num_layers,
        "requests": num_requests,
        "seed": config.seed,
        "device_pages": config.device_pages,
        "host_pages": config.host_pages,
        "workload": workload,
    }


def _verified_fields(sides: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "verified_pages": sum(s["verified_pages"] for s in sides),
        "restored_pages_verified": sum(s["restored_pages_verified"] for s in sides),
        "corrupted_pages": sum(s["corrupted_pages"] for s in sides),
        "nothing_verified": sum(s["verified_pages"] for s in sides) == 0,
    }


def _cache_fields(reports: list[RankReport], sides: list[dict[str, Any]], rank0: RankReport) -> dict[str, Any]:
    """What the caches did: logical counts (identical on every rank) from
    rank 0, physical ones per rank."""
    return {
        "backup_tokens": rank0.totals.backup_tokens,
        "backup_slots_per_rank": [r.totals.backup_slots for r in reports],
        "write_backups_per_rank": [r.totals.write_backups for r in reports],
        "load_backs": rank0.totals.load_backs,
        "load_back_tokens": rank0.totals.load_back_tokens,
        "load_slots_per_rank": [r.totals.load_slots for r in reports],
        "host_evicted_slots": sum(r.totals.host_evicted_slots for r in reports),
        "host_evicted_slots_per_rank": [r.totals.host_evicted_slots for r in reports],
        "write_failures": rank0.totals.write_failures,
        "device_evicted_tokens": sides[0]["device_evicted_tokens"],
        "device_reclaimed_tokens": sides[0]["device_reclaimed_tokens"],
        "host_balance": rank0.totals.host_balance or None,
        "lane_reclaims_per_rank": [r.totals.lane_reclaims for r in reports],
        "uneven_picks_per_rank": [r.totals.uneven_picks for r in reports],
        "device_hit_tokens": sides[0]["device_hit_tokens"],
        "host_hit_tokens": sides[0]["host_hit_tokens"],
        "skipped_requests": sides[0]["skipped_requests"],
        "load_backs_refused": sides[0]["load_backs_refused"],
        "host_slots_per_rank": [s["host_slots"] for s in sides],
        "host_slot_capacity_per_rank": [s["host_slot_capacity"] for s in sides],
        "acks_per_rank": [_acks_dict(r.acks) for r in reports],
        "zero_owned_writes_per_rank": [r.totals.zero_owned_writes for r in reports],
        "zero_owned_loads_per_rank": [r.totals.zero_owned_loads for r in reports],
    }


def _acks_dict(acks: AckCounts) -> dict[str, int]:
    return {"writes_queued": acks.writes_queued, "loads_queued": acks.loads_queued,
            "write_acks": acks.write_acks, "load_acks": acks.load_acks}


def _agreement_fields(reports: list[RankReport], rank0: RankReport) -> dict[str, Any]:
    """Whether the ranks agree: rank 0's all_gather verdict and the reports
    themselves must both say so."""
    agreement = rank0.agreement or {}
    digests = [r.totals.tree_digest for r in reports]
    acks = [r.acks.as_tuple() for r in reports]
    ranks_agree = bool(agreement.get("digests_agree")) and bool(agreement.get("acks_agree")) \
        and all(a == acks[0] for a in acks) and len(set(digests)) == 1
    return {
        "ranks_agree": ranks_agree,
        "tree_digests": digests,
        "invariant_violations": [f"rank {r.rank}: {v}" for r in reports for v in r.totals.invariant_violations],
    }


def _cpu_fields(reports: list[RankReport]) -> dict[str, Any]:
    return {
        "cpu_seconds": mean([r.cpu_seconds for r in reports]),
        "cpu_seconds_per_rank": [r.cpu_seconds for r in reports],
        "cache_cpu_seconds_per_rank": [r.cache_cpu_seconds for r in reports],
        "content_cpu_seconds_per_rank": [r.content_cpu_seconds for r in reports],
        "collective_cpu_seconds_per_rank": [r.collective_cpu_seconds for r in reports],
        "collective_calls_per_rank": [r.collective_calls for r in reports],
        "startup_seconds_per_rank": [r.startup_seconds for r in reports],
    }


def _copy_fields(reports: list[RankReport]) -> dict[str, Any]:
    return {
        "copies": _copies(reports),
        "indexer_pages_verified": sum(r.indexer_pages_verified for r in reports),
        "copy_path_cpu_seconds_per_rank": [r.copy_path_cpu for r in reports],
        "device_page_reads_per_rank": [r.totals.device_page_reads for r in reports],
    }


def _l3_fields(config: SimConfig, reports: list[RankReport]) -> dict[str, Any]:
    """--l3: what each rank wrote to and restored from L3 (own pages, so
    the totals are sums), and how many restored pages the content check
    verified. The non-CP baseline runs without L3."""
    t = [r.totals for r in reports]
    verified = [sum(rec.l3_pages_verified for rec in r.records) for r in reports]
    return {
        "l3_dir": config.l3_label,  # a directory, or mooncake://HOST:PORT
        "l3_backend": "file" if config.l3_mooncake is None else "mooncake",
        "l3_written_pages": sum(x.l3_written_pages for x in t),
        "l3_written_pages_per_rank": [x.l3_written_pages for x in t],
        "l3_hit_tokens": sum(x.l3_hit_tokens for x in t),
        "l3_hit_tokens_per_rank": [x.l3_hit_tokens for x in t],
        "l3_pages_verified": sum(verified),
        "l3_pages_verified_per_rank": verified,
        "l3_rejected_objects": sum(x.l3_rejected_objects for x in t),
        "l3_rejected_objects_per_rank": [x.l3_rejected_objects for x in t],
        # what the store lost or refused: failed / dropped page writes, pages found but not read whole,
        # lookups given up at their deadline (each a miss, never an error)
        **{f"l3_{name}": sum(getattr(x, f"l3_{name}") for x in t)
           for name in ("write_failures", "dropped_writes", "read_failures", "timeouts")},
        # filled in by the launcher from the directory's writer manifests (sim.l3_writers)
        "l3_restored_pages_by_writer": {},
        "l3_restored_from_other_release": 0,
    }


def _bookkeeping_fields(reports: list[RankReport], rank0: RankReport) -> dict[str, Any]:
    """0.5.23: what the tree's bookkeeping did, counted alike on both copy
    paths. Backups, hits and evictions are decisions every rank takes alike
    (the totals are rank 0's); each rank reads its own device locs, so those
    reads add up over ranks. The library stack's own counters per rank."""
    t = [r.totals for r in reports]
    library = {}
    if rank0.totals.host_room:
        library = {
            "host_room": rank0.totals.host_room,
            "host_room_per_rank": [x.host_room for x in t],
            "device_frees_per_rank": [x.device_frees for x in t],
            "warmup_per_rank": [x.warmup for x in t],
        }
    return {
        "backups_attempted": rank0.totals.backups_attempted,
        "write_failures_per_rank": [x.write_failures for x in t],
        "host_hit_tokens_per_rank": [sum(rec.host_hit_tokens for rec in r.records) for r in reports],
        "device_evictions": rank0.totals.device_evictions,
        "device_evictions_per_rank": [x.device_evictions for x in t],
        "device_eviction_tokens": rank0.totals.device_eviction_tokens,
        "device_eviction_tokens_per_rank": [x.device_eviction_tokens for x in t],
        "device_index_host_reads": sum(x.device_index_host_reads for x in t),
        "device_index_host_reads_per_rank": [x.device_index_host_reads for x in t],
        "request_free_reads_per_rank": [x.request_free_reads for x in t],
        **library,
    }


def _cp_problems(summary: dict[str, Any], reports: list[RankReport], allow_unverified: bool) -> list[str]:
    problems: list[str] = []
    if not summary["ranks_agree"]:
        problems.append(f"ranks disagree: tree digests {summary['tree_digests']}, "
                        f"acks {[r.acks.as_tuple() for r in reports]}")
    if summary["corrupted_pages"]:
        problems.append(f"{summary['corrupted_pages']} corrupted pages")
    problems += summary["invariant_violations"]
    if summary["nothing_verified"] and not allow_unverified:
        problems.append(f"{NOTHING_VERIFIED} (pass --allow-unverified to accept such a run)")
    return problems


def _add_non_cp(
    summary: dict[str, Any], config: SimConfig, num_requests: int, cp: LaunchResult, non_cp: LaunchResult
) -> list[str]:
    """Add the non-CP run and the comparison to ``summary``; its problems."""
    ref = next((r for r in non_cp.reports if r.rank == -1), non_cp.reports[0])
    side = _side(ref)
    # Per-rank means over the baseline's processes (identical work on each).
    for key in ("cpu_seconds", "cache_cpu_seconds", "collective_cpu_seconds", "content_cpu_seconds"):
        side[key] = mean([getattr(r, key) for r in non_cp.reports])
    summary["non_cp"] = {
        "group": _group_text(config),
        "processes": len(non_cp.reports),
        "device_pages": config.non_cp_device_pages,
        "host_pages": config.host_pages * config.cp_size,
        **side,
        "acks": _acks_dict(ref.acks),
    }
    summary["series"]["non_cp_host_slots"] = [rec.host_slots for rec in ref.records]
    problems = [f"non-CP run: {side['corrupted_pages']} corrupted pages"] if side["corrupted_pages"] else []
    problems += [f"non-CP run: {v}" for v in side["invariant_violations"]]
    summary["comparison"] = _compare(summary, side, config.cp_size, config.page_size,
                                     host_goal=config.sglang_version == "0.5.18")
    rank0 = next(r for r in cp.reports if r.rank == 0)
    summary["comparison"]["requests_with_identical_hits"] = sum(
        (a.device_hit_tokens, a.host_hit_tokens, a.loaded_tokens)
        == (b.device_hit_tokens, b.host_hit_tokens, b.loaded_tokens)
        for a, b in zip(rank0.records, ref.records)
    )
    summary["non_cp_group"] = _group_text(config)
    summary["all_reduces_per_request"] = {
        "cp": mean([r.collective_calls for r in cp.reports]) / max(num_requests, 1),
        "non_cp": mean([r.collective_calls for r in non_cp.reports]) / max(num_requests, 1),
    }
    summary["cache_cpu_ratio"] = summary["comparison"]["cache_cpu_ratio"]
    summary.update(capacity_fields(summary, ref))
    summary["non_cp"]["startup_wall_seconds"] = non_cp.startup_seconds
    summary["series"]["non_cp_hit_tokens"] = [rec.device_hit_tokens + rec.host_hit_tokens for rec in ref.records]
    return problems


def _group_text(config: SimConfig) -> str:
    if config.non_cp_group == "tp":
        return (f"tp: {config.cp_size} processes on one gloo group, each with the whole pool "
                "(replicated MLA KV, the same per-step ack all-reduce as the CP ranks)")
    return "single: one process, no process group (no all-reduce at all)"


def _copies(reports: list[RankReport]) -> dict[str, Any]:
    """What ``kernels.transfer`` counted in the rank processes: totals over
    ranks, the backend and cp_size the ranks used, and each rank's own."""
    per_rank = [r.copies for r in reports]
    keys = ("kv_backup_calls", "kv_load_calls", "indexer_backup_calls", "indexer_load_calls", "pages_copied")
    out: dict[str, Any] = {k: sum(c.get(k, 0) for c in per_rank) for k in keys}
    backends = sorted({c.get("backend") for c in per_rank if c.get("backend")})
    sizes = sorted({c.get("cp_size") for c in per_rank if c.get("cp_size") is not None})
    out["backend"] = backends[0] if len(backends) == 1 else (backends or None)
    out["cp_size"] = sizes[0] if len(sizes) == 1 else (sizes or None)
    out["per_rank"] = per_rank
    return out


def _compare(summary: dict[str, Any], non_cp: dict[str, Any], N: int, P: int, *,
             host_goal: bool = True) -> dict[str, Any]:
    """The CP run against non-CP. The host-slot goal is 0.5.18's (its exact
    host balance); on 0.5.23 upstream's tree picks host evictions, so
    ``host_slots_goal`` / ``host_slots_goal_met`` are None there. Goals are
    targets: only the checks (``problems``) decide ``ok``."""
    ref_peak = non_cp["host_slots"]
    fractions = [p / ref_peak if ref_peak else None for p in summary["host_slots_per_rank"]]
    series = summary["series"]
    ref_total = sum(series.get("non_cp_host_slots", []))
    mean_fractions = [sum(s) / ref_total if ref_total else None for s in series["host_slots_per_rank"]]
    goal_slots = ref_peak / N + P
    cp_cpu = summary["cpu_seconds"]
    cp_cache = mean(summary["cache_cpu_seconds_per_rank"])
    cp_content = mean(summary["content_cpu_seconds_per_rank"])
    cp_collective = mean(summary["collective_cpu_seconds_per_rank"])
    ratio = cp_cpu / non_cp["cpu_seconds"] if non_cp["cpu_seconds"] else None
    cache_ratio = cp_cache / non_cp["cache_cpu_seconds"] if non_cp["cache_cpu_seconds"] else None
    return {
        "host_slots_fraction_per_rank": fractions,
        "host_slots_mean_fraction_per_rank": mean_fractions,
        "host_slots_goal": f"peak per rank within {P} slots (one page) of non-CP peak / {N}" if host_goal else None,
        "host_slots_goal_slots": goal_slots,
        "host_slots_goal_fraction": goal_slots / ref_peak if ref_peak else None,
        "host_slots_deviation_pages_per_rank": [
            (p - ref_peak / N) / P for p in summary["host_slots_per_rank"]
        ],
        "host_slots_goal_met": all(abs(p - ref_peak / N) <= P for p in summary["host_slots_per_rank"])
        if host_goal else None,
        "cpu_ratio": ratio,
        "cpu_goal": f"mean per-rank replay CPU s (CP) / replay CPU s (non-CP) <= {CPU_GOAL}",
        "cpu_goal_met": ratio is not None and ratio <= CPU_GOAL,
        "cache_cpu_ratio": cache_ratio,
        "cache_cpu_goal": f"mean per-rank cache-call CPU s (CP) / cache-call CPU s (non-CP) <= {CACHE_CPU_GOAL}",
        "cache_cpu_goal_met": cache_ratio is not None and cache_ratio <= CACHE_CPU_GOAL,
        "cache_cpu_ratio_without_collectives": (
            (cp_cache - cp_collective) / (non_cp["cache_cpu_seconds"] - non_cp["collective_cpu_seconds"])
            if non_cp["cache_cpu_seconds"] > non_cp["collective_cpu_seconds"] else None
        ),
        "content_cpu_ratio": cp_content / non_cp["content_cpu_seconds"] if non_cp["content_cpu_seconds"] else None,
        "load_back_tokens_cp_vs_non_cp": [summary["load_back_tokens"], non_cp["load_back_tokens"]],
        "host_evicted_tokens_cp_vs_non_cp": [summary["host_evicted_slots"], non_cp["host_evicted_slots"]],
    }


def failure_message(result: LaunchResult) -> str:
    """Who failed first and why (the headline), then what happened to the others."""
    lines = []

    def who(rank: int) -> str:
        if rank >= 0:
            return f"rank {rank}"
        return "the non-CP process" if rank == -1 else f"non-CP process {-1 - rank}"

    def log_of(rank: int) -> str:
        return os.path.join(result.log_dir, f"{log_name(rank)}.log")

    def at(step: Optional[int]) -> str:
        if step == AFTER_REPLAY:
            return " after the replay"
        return f" at request {step}" if step is not None else " during startup"

    cause = first_cause(result)
    if cause is None:
        lines.append(f"{result.label}: a process ended without a report (output: {result.log_dir})")
        return "\n".join(lines)
    if cause.kind == "died":
        lines.append(f"{result.label}: {who(cause.rank)} died first: {cause.detail}")
        lines.append(f"  its output: {log_of(cause.rank)}")
    elif cause.kind == "hung":
        lines.append(
            f"{result.label}: {who(cause.rank)} stopped answering collectives: its peers gave up waiting for "
            f"it (--collective-timeout), it sent no report and did not exit, so the launcher terminated it"
        )
        lines.append(f"  its output: {log_of(cause.rank)}")
    else:
        lines.append(f"{result.label}: {who(cause.rank)} failed{at(cause.step)}: {cause.detail[:400]}")
        if cause.kind == "symptom" and "timed out" in cause.detail.lower():
            lines.append("  (it waited longer than --collective-timeout for a peer: another rank stopped "
                         "answering collectives)")
        lines.append(f"  traceback and output: {log_of(cause.rank)}")
    for other in later_failures(result, cause):
        error = other.error.splitlines()[0] if other.error else ""
        lines.append(f"  then {who(other.rank)} failed{at(other.step)}: {error[:200]}")
    reported = {f.rank for f in result.failures} | {r.rank for r in result.reports}
    for rank, code in sorted(result.exit_codes.items()):
        if rank == cause.rank:
            continue
        if rank in result.killed:
            lines.append(f"  {who(rank)} did not exit within the grace period and was terminated")
        elif rank not in reported and code != 0:
            lines.append(f"  {who(rank)} {describe_exit(code)} without a report")
    lines.append(f"  logs of every process: {result.log_dir}")
    return "\n".join(lines)


def dump_json(summary: dict[str, Any]) -> str:
    """One key per line down to the second level; values (lists, series)
    compact, so the file stays small and diffable."""
    def block(obj: dict[str, Any], indent: str) -> str:
        items = []
        for key, value in obj.items():
            if isinstance(value, dict) and indent == "":
                items.append(f"{indent} {json.dumps(key)}: {block(value, indent + ' ')}")
            else:
                items.append(f"{indent} {json.dumps(key)}: {json.dumps(value)}")
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"

    return block(summary, "") + "\n"
