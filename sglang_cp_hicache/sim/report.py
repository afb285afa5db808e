"""Turn rank reports into the summary (JSON) and the table (stdout).

Definitions used in the comparison with the non-CP run:

* host slots: physical host KV slots in use (tokens), sampled after every
  request; a rank's *peak* is the maximum over the run. The CP goal is
  ``peak(rank) <= peak(non-CP) / N + page_size`` for every rank.
* CPU seconds: process CPU time (``time.process_time``: user + system of the
  whole process, gloo threads included) of the request replay only -- after
  ``import sglang``, the process group and the stack build, which both runs
  pay alike and which are reported separately as ``startup_seconds``. The CP
  figure is the mean over ranks; the goal is ``mean(CP) / non-CP <= 1.10``.
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
from sglang_cp_hicache.sim.records import RankReport

__all__ = [
    "CPU_GOAL",
    "NOTHING_VERIFIED",
    "Verdict",
    "dump_json",
    "failure_message",
    "format_table",
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


def _mean(values: list[float]) -> float:
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
) -> tuple[dict[str, Any], Verdict]:
    """The JSON summary and whether the run passed. Only call with every
    rank's report present (``cp.ok``). A run that verified no page at all
    proves nothing, so it fails unless ``allow_unverified``."""
    reports = cp.reports
    N, P = config.cp_size, config.page_size
    sides = [_side(r) for r in reports]
    problems: list[str] = []
    rank0 = next(r for r in reports if r.rank == 0)
    agreement = rank0.agreement or {}
    digests = [r.totals.tree_digest for r in reports]
    acks = [r.acks for r in reports]
    acks_agree = all(a.as_tuple() == acks[0].as_tuple() for a in acks)
    digests_agree = len(set(digests)) == 1
    ranks_agree = bool(agreement.get("digests_agree")) and bool(agreement.get("acks_agree")) \
        and acks_agree and digests_agree
    if not ranks_agree:
        problems.append(f"ranks disagree: tree digests {digests}, acks {[a.as_tuple() for a in acks]}")
    corrupted = sum(s["corrupted_pages"] for s in sides)
    if corrupted:
        problems.append(f"{corrupted} corrupted pages")
    violations = [f"rank {r.rank}: {v}" for r in reports for v in r.totals.invariant_violations]
    problems += violations
    nothing_verified = sum(s["verified_pages"] for s in sides) == 0
    if nothing_verified and not allow_unverified:
        problems.append(f"{NOTHING_VERIFIED} (pass --allow-unverified to accept such a run)")
    summary: dict[str, Any] = {
        "sglang_version": config.sglang_version,
        "copy_path": config.copy_path,
        "cp_size": N,
        "page_size": P,
        "layers": config.num_layers,
        "requests": num_requests,
        "seed": config.seed,
        "device_pages": config.device_pages,
        "host_pages": config.host_pages,
        "workload": workload,
        "verified_pages": sum(s["verified_pages"] for s in sides),
        "restored_pages_verified": sum(s["restored_pages_verified"] for s in sides),
        "corrupted_pages": corrupted,
        "nothing_verified": nothing_verified,
        "backup_tokens": rank0.totals.backup_tokens,
        "backup_slots_per_rank": [r.totals.backup_slots for r in reports],
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
        "acks_per_rank": [
            {"writes_queued": a.writes_queued, "loads_queued": a.loads_queued,
             "write_acks": a.write_acks, "load_acks": a.load_acks}
            for a in acks
        ],
        "zero_owned_writes_per_rank": [r.totals.zero_owned_writes for r in reports],
        "zero_owned_loads_per_rank": [r.totals.zero_owned_loads for r in reports],
        "ranks_agree": ranks_agree,
        "tree_digests": digests,
        "invariant_violations": violations,
        "cpu_seconds": _mean([r.cpu_seconds for r in reports]),
        "cpu_seconds_per_rank": [r.cpu_seconds for r in reports],
        "cache_cpu_seconds_per_rank": [r.cache_cpu_seconds for r in reports],
        "content_cpu_seconds_per_rank": [r.content_cpu_seconds for r in reports],
        "collective_cpu_seconds_per_rank": [r.collective_cpu_seconds for r in reports],
        "collective_calls_per_rank": [r.collective_calls for r in reports],
        "startup_seconds_per_rank": [r.startup_seconds for r in reports],
        "replay_wall_seconds": max(r.wall_seconds for r in reports),
        "copies": _copies(reports),
        "indexer_pages_verified": sum(r.indexer_pages_verified for r in reports),
        "copy_path_cpu_seconds_per_rank": [r.copy_path_cpu for r in reports],
        "device_page_reads_per_rank": [r.totals.device_page_reads for r in reports],
        "series": {
            "host_slots_per_rank": [[rec.host_slots for rec in r.records] for r in reports],
            "device_hit_tokens": [rec.device_hit_tokens for rec in rank0.records],
            "host_hit_tokens": [rec.host_hit_tokens for rec in rank0.records],
            "loaded_tokens": [rec.loaded_tokens for rec in rank0.records],
        },
    }
    if non_cp is not None and non_cp.reports:
        ref = next((r for r in non_cp.reports if r.rank == -1), non_cp.reports[0])
        side = _side(ref)
        nc_ranks = len(non_cp.reports)
        # Per-rank means over the baseline's processes (identical work on each).
        for key, attr in (("cpu_seconds", "cpu_seconds"), ("cache_cpu_seconds", "cache_cpu_seconds"),
                          ("collective_cpu_seconds", "collective_cpu_seconds"),
                          ("content_cpu_seconds", "content_cpu_seconds")):
            side[key] = _mean([getattr(r, attr) for r in non_cp.reports])
        summary["non_cp"] = {
            "group": _group_text(config),
            "processes": nc_ranks,
            "device_pages": config.logical_device_pages - 1,
            "host_pages": config.host_pages * N,
            **{k: v for k, v in side.items()},
            "acks": {"writes_queued": ref.acks.writes_queued, "loads_queued": ref.acks.loads_queued,
                     "write_acks": ref.acks.write_acks, "load_acks": ref.acks.load_acks},
        }
        summary["series"]["non_cp_host_slots"] = [rec.host_slots for rec in ref.records]
        if side["corrupted_pages"]:
            problems.append(f"non-CP run: {side['corrupted_pages']} corrupted pages")
        problems += [f"non-CP run: {v}" for v in side["invariant_violations"]]
        summary["comparison"] = _compare(summary, side, N, P)
        same = sum(
            (a.device_hit_tokens, a.host_hit_tokens, a.loaded_tokens)
            == (b.device_hit_tokens, b.host_hit_tokens, b.loaded_tokens)
            for a, b in zip(rank0.records, ref.records)
        )
        summary["comparison"]["requests_with_identical_hits"] = same
        summary["non_cp_group"] = _group_text(config)
        summary["all_reduces_per_request"] = {
            "cp": _mean([r.collective_calls for r in reports]) / max(num_requests, 1),
            "non_cp": _mean([r.collective_calls for r in non_cp.reports]) / max(num_requests, 1),
        }
        summary["cache_cpu_ratio"] = summary["comparison"]["cache_cpu_ratio"]
    summary["ok"] = not problems
    summary["problems"] = problems
    return summary, Verdict(ok=not problems, problems=problems)


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


def _compare(summary: dict[str, Any], non_cp: dict[str, Any], N: int, P: int) -> dict[str, Any]:
    ref_peak = non_cp["host_slots"]
    fractions = [p / ref_peak if ref_peak else None for p in summary["host_slots_per_rank"]]
    series = summary["series"]
    ref_total = sum(series.get("non_cp_host_slots", []))
    mean_fractions = [sum(s) / ref_total if ref_total else None for s in series["host_slots_per_rank"]]
    goal_slots = ref_peak / N + P
    cp_cpu = summary["cpu_seconds"]
    cp_cache = _mean(summary["cache_cpu_seconds_per_rank"])
    cp_content = _mean(summary["content_cpu_seconds_per_rank"])
    cp_collective = _mean(summary["collective_cpu_seconds_per_rank"])
    ratio = cp_cpu / non_cp["cpu_seconds"] if non_cp["cpu_seconds"] else None
    cache_ratio = cp_cache / non_cp["cache_cpu_seconds"] if non_cp["cache_cpu_seconds"] else None
    return {
        "host_slots_fraction_per_rank": fractions,
        "host_slots_mean_fraction_per_rank": mean_fractions,
        "host_slots_goal": f"peak per rank within {P} slots (one page) of non-CP peak / {N}",
        "host_slots_goal_slots": goal_slots,
        "host_slots_goal_fraction": goal_slots / ref_peak if ref_peak else None,
        "host_slots_deviation_pages_per_rank": [
            (p - ref_peak / N) / P for p in summary["host_slots_per_rank"]
        ],
        "host_slots_goal_met": all(abs(p - ref_peak / N) <= P for p in summary["host_slots_per_rank"]),
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


def _copies_line(copies: dict[str, Any]) -> str:
    if copies["backend"] is None:
        return "copies through sglang_cp_hicache.kernels.transfer: none (another copy path ran them)"
    return (
        f"copies through sglang_cp_hicache.kernels.transfer: backend {copies['backend']}, "
        f"cp_size {copies['cp_size']}; KV backup/load calls {copies['kv_backup_calls']}/"
        f"{copies['kv_load_calls']}, indexer {copies['indexer_backup_calls']}/"
        f"{copies['indexer_load_calls']}, owned pages moved {copies['pages_copied']} (all ranks)"
    )


def format_table(summary: dict[str, Any]) -> str:
    N = summary["cp_size"]
    P = summary["page_size"]
    non_cp = summary.get("non_cp")
    cols = [f"rank {r}" for r in range(N)] + (["non-CP"] if non_cp else [])
    acks = summary["acks_per_rank"]

    def row(name: str, per_rank: list[Any], ref: Any = "") -> str:
        cells = [_fmt(v) for v in per_rank] + ([_fmt(ref)] if non_cp else [])
        return f"{name:<26}" + "".join(f"{c:>12}" for c in cells)

    nc = non_cp or {}
    lines = [
        f"CP HiCache simulation (SGLang {summary['sglang_version']}, copies: {summary['copy_path']}): "
        f"cp_size={N} page_size={P} layers={summary['layers']} "
        f"requests={summary['requests']} workload={summary['workload']} seed={summary['seed']}",
        f"per rank: device {summary['device_pages']} pages, host {summary['host_pages']} pages"
        + (f"; non-CP: device {nc['device_pages']} pages, host {nc['host_pages']} pages" if non_cp else ""),
        "",
        f"{'':<26}" + "".join(f"{c:>12}" for c in cols),
        row("peak host slots", summary["host_slots_per_rank"], nc.get("host_slots")),
        row("host slot capacity", summary["host_slot_capacity_per_rank"], nc.get("host_slot_capacity")),
        row("backup slots written", summary["backup_slots_per_rank"], nc.get("backup_slots")),
        row("host slots evicted", summary["host_evicted_slots_per_rank"], nc.get("host_evicted_slots")),
        row("slots loaded back", summary["load_slots_per_rank"], nc.get("load_back_tokens")),
        row("write ops / acks", [f"{a['writes_queued']}/{a['write_acks']}" for a in acks],
            f"{nc['acks']['writes_queued']}/{nc['acks']['write_acks']}" if non_cp else ""),
        row("load ops / acks", [f"{a['loads_queued']}/{a['load_acks']}" for a in acks],
            f"{nc['acks']['loads_queued']}/{nc['acks']['load_acks']}" if non_cp else ""),
        row("replay CPU s", summary["cpu_seconds_per_rank"], nc.get("cpu_seconds")),
        row("  in cache calls", summary["cache_cpu_seconds_per_rank"], nc.get("cache_cpu_seconds")),
        row("    in all-reduces", summary["collective_cpu_seconds_per_rank"], nc.get("collective_cpu_seconds")),
        row("  writing/checking KV", summary["content_cpu_seconds_per_rank"], nc.get("content_cpu_seconds")),
        row("startup s (import+build)", summary["startup_seconds_per_rank"], nc.get("startup_seconds")),
        "",
        f"logical tokens: device hits {summary['device_hit_tokens']}, host hits {summary['host_hit_tokens']}, "
        f"loaded back {summary['load_back_tokens']} ({summary['load_backs']} load-backs), "
        f"backed up {summary['backup_tokens']}, device-evicted {summary['device_evicted_tokens']}"
        + (f" (of which {summary['device_reclaimed_tokens']} for host balance)"
           if summary.get("device_reclaimed_tokens") else "") + ", "
        f"load-backs refused {summary['load_backs_refused']}, skipped requests {summary['skipped_requests']}",
        f"pages verified bit-exact: {summary['verified_pages']} "
        f"(of which just restored: {summary['restored_pages_verified']}), "
        f"corrupted: {summary['corrupted_pages']}; indexer pages verified: {summary['indexer_pages_verified']}"
        + (f"; non-CP verified {nc['verified_pages']}, corrupted {nc['corrupted_pages']}" if non_cp else ""),
        f"ranks agree (tree digest + acks, all_gather): {'yes' if summary['ranks_agree'] else 'NO'}",
        _copies_line(summary["copies"]),
    ]
    path_cpu = [c for c in summary["copy_path_cpu_seconds_per_rank"] if c]
    if path_cpu:
        prep = _mean([c["prepare_seconds"] for c in path_cpu])
        sub = _mean([c["submit_seconds"] for c in path_cpu])
        lines.append(f"CPU s per rank in the sharded copy path ({summary['copy_path']}): "
                     f"prepare {_fmt(prep)} + submit {_fmt(sub)}")
    if "all_reduces_per_request" in summary:
        a = summary["all_reduces_per_request"]
        lines.append(
            f"all-reduces per request per rank: CP {_fmt(a['cp'])}, non-CP {_fmt(a['non_cp'])} "
            f"(non-CP baseline: {summary['non_cp_group'].split(':')[0]} with "
            f"{non_cp['processes']} process{'es' if non_cp['processes'] > 1 else ''})"
        )
    comp = summary.get("comparison")
    if comp:
        fr = ", ".join(_fmt(f) for f in comp["host_slots_fraction_per_rank"])
        mean_fr = ", ".join(_fmt(f) for f in comp["host_slots_mean_fraction_per_rank"])
        dev = ", ".join(f"{d:+.2f}" for d in comp["host_slots_deviation_pages_per_rank"])
        lines.append(
            f"peak host slots per rank / non-CP peak: {fr}, i.e. {dev} pages from 1/{N} (goal: within "
            f"1 page: {'met' if comp['host_slots_goal_met'] else 'MISSED'}); time-averaged: {mean_fr}"
            + (f"; host balance: {summary['host_balance']}" if summary.get("host_balance") else "")
        )
        lines.append(
            f"replay CPU s, CP mean per rank / non-CP: {_fmt(comp['cpu_ratio'])} (goal <= {CPU_GOAL}: "
            f"{'met' if comp['cpu_goal_met'] else 'MISSED'}); in cache calls {_fmt(comp['cache_cpu_ratio'])} "
            f"(goal <= {CACHE_CPU_GOAL}: {'met' if comp['cache_cpu_goal_met'] else 'MISSED'}; "
            f"{_fmt(comp['cache_cpu_ratio_without_collectives'])} without all-reduces), "
            f"KV content {_fmt(comp['content_cpu_ratio'])}"
        )
        lines.append(
            f"requests with the same device/host hits and restores as non-CP: "
            f"{comp['requests_with_identical_hits']}/{summary['requests']}"
        )
    if not summary["ok"]:
        lines.append("result: FAILED: " + "; ".join(summary["problems"]))
    elif summary.get("nothing_verified"):
        lines.append(f"result: OK, but NOTHING WAS VERIFIED: {NOTHING_VERIFIED}")
    else:
        lines.append("result: OK")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)



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
