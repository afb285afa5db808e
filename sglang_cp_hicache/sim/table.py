"""The text report the simulator prints: one column per CP rank (and the
non-CP run), then the totals, the copy path and the comparison, all read off
the summary :func:`.report.summarize` builds."""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.sim.report import CACHE_CPU_GOAL, CPU_GOAL, NOTHING_VERIFIED, mean

__all__ = ["format_table"]

_NAME_WIDTH = 26
_CELL_WIDTH = 12


def format_table(summary: dict[str, Any]) -> str:
    nc = summary.get("non_cp") or {}
    lines = [*_header(summary, nc), "", *_per_rank_rows(summary, nc), "", *_rate_lines(summary),
             *_totals_lines(summary, nc)]
    path_cpu = [c for c in summary["copy_path_cpu_seconds_per_rank"] if c]
    if path_cpu:
        prep = mean([c["prepare_seconds"] for c in path_cpu])
        sub = mean([c["submit_seconds"] for c in path_cpu])
        lines.append(f"CPU s per rank in the sharded copy path ({summary['copy_path']}): "
                     f"prepare {_fmt(prep)} + submit {_fmt(sub)}")
    if "all_reduces_per_request" in summary:
        a = summary["all_reduces_per_request"]
        lines.append(
            f"all-reduces per request per rank: CP {_fmt(a['cp'])}, non-CP {_fmt(a['non_cp'])} "
            f"(non-CP baseline: {summary['non_cp_group'].split(':')[0]} with "
            f"{nc['processes']} process{'es' if nc['processes'] > 1 else ''})"
        )
    if summary.get("comparison"):
        lines += _comparison_lines(summary, summary["comparison"])
    lines.append(_result_line(summary))
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.3f} GB"


def _rate_lines(summary: dict[str, Any]) -> list[str]:
    """Hits per tier against the prompt and the ideal, bytes per tier and
    direction, the copy path's GB/s, start-up apart from the replay."""
    tiers, rate = summary["hit_tokens_per_tier"], summary["hit_rate_per_tier"]
    ratio = summary["hit_ratio_per_tier"]
    moved, gbps = summary["bytes_moved"], summary["copy_gbps"]
    lines = [
        f"prompt tokens {summary['prompt_tokens']:,}; ideal (an infinite cache starting empty, page-aligned) "
        f"{summary['ideal_hit_tokens']:,} = {_pct(summary['ideal_hit_rate'])} of the prompt",
        "hits: " + ", ".join(f"{t} {tiers[t]:,} ({_pct(rate[t])} of prompt, {_pct(ratio[t])} of ideal)"
                             for t in ("device", "host", "l3"))
        + f"; all {summary['hit_tokens']:,} = hit_ratio {_fmt(summary['hit_ratio'])} of the ideal",
        *_warm_l3_line(summary),
    ]
    if "capacity_efficiency" in summary:
        lines.append(
            f"non-CP ({summary['non_cp']['device_pages']} device / {summary['non_cp']['host_pages']} host pages, "
            f"no L3): hits {summary['non_cp_hit_tokens']:,} = {_fmt(summary['non_cp_hit_ratio'])} of the ideal; "
            f"capacity_efficiency (CP hits / non-CP hits) {_fmt(summary['capacity_efficiency'])}"
        )
    lines += [
        f"bytes moved (all ranks, page = {summary['page_bytes']:,} B): host d2h {_gb(moved['host_d2h'])}, "
        f"h2d {_gb(moved['host_h2d'])}; L3 write {_gb(moved['l3_write'])}, read {_gb(moved['l3_read'])}; "
        f"copy path (CPU s in the L2 copies) d2h {_fmt(gbps['d2h'])} GB/s, h2d {_fmt(gbps['h2d'])} GB/s "
        "per rank",
        f"time: start-up {_fmt(summary.get('startup_wall_seconds'))} s (spawn to every stack built), "
        f"replay {_fmt(summary['replay_wall_seconds'])} s (slowest rank), whole run "
        f"{_fmt(summary.get('run_wall_seconds'))} s",
    ]
    return lines


def _warm_l3_line(summary: dict[str, Any]) -> list[str]:
    """Why hit_ratio can exceed 1: the ideal starts empty, the L3 did not."""
    held = summary.get("l3_objects_at_start")
    if not held:
        return []
    return [f"the L3 directory held {held:,} objects at the start (earlier runs): the ideal starts empty, so "
            "hits of what L3 already held can take hit_ratio above 1"]


def _header(summary: dict[str, Any], nc: dict[str, Any]) -> list[str]:
    sizing = summary.get("pool_sizing")
    return [
        f"CP HiCache simulation (SGLang {summary['sglang_version']}, copies: {summary['copy_path']}): "
        f"cp_size={summary['cp_size']} page_size={summary['page_size']} layers={summary['layers']} "
        f"requests={summary['requests']} workload={summary['workload']} seed={summary['seed']}",
        f"per rank: device {summary['device_pages']} pages, host {summary['host_pages']} pages"
        + (f"; non-CP: device {nc['device_pages']} pages, host {nc['host_pages']} pages" if nc else "")
        + (f" (sized from the trace: {sizing['distinct_pages']:,} distinct pages, --capacity {sizing['capacity']:g};"
           f" device from {sizing['device_from']}, host from {sizing['host_from']})" if sizing else ""),
    ]


def _per_rank_rows(summary: dict[str, Any], nc: dict[str, Any]) -> list[str]:
    """The table: a column per rank, then the non-CP run's when there is one."""
    cols = [f"rank {r}" for r in range(summary["cp_size"])] + (["non-CP"] if nc else [])
    acks = summary["acks_per_rank"]

    def row(name: str, per_rank: list[Any], ref: Any = "") -> str:
        cells = [_fmt(v) for v in per_rank] + ([_fmt(ref)] if nc else [])
        return f"{name:<{_NAME_WIDTH}}" + "".join(f"{c:>{_CELL_WIDTH}}" for c in cells)

    nc_acks = nc.get("acks", {})
    return [
        f"{'':<{_NAME_WIDTH}}" + "".join(f"{c:>{_CELL_WIDTH}}" for c in cols),
        row("peak host slots", summary["host_slots_per_rank"], nc.get("host_slots")),
        row("host slot capacity", summary["host_slot_capacity_per_rank"], nc.get("host_slot_capacity")),
        row("backup slots written", summary["backup_slots_per_rank"], nc.get("backup_slots")),
        row("host slots evicted", summary["host_evicted_slots_per_rank"], nc.get("host_evicted_slots")),
        row("slots loaded back", summary["load_slots_per_rank"], nc.get("load_back_tokens")),
        row("write ops / acks", [f"{a['writes_queued']}/{a['write_acks']}" for a in acks],
            f"{nc_acks['writes_queued']}/{nc_acks['write_acks']}" if nc else ""),
        row("load ops / acks", [f"{a['loads_queued']}/{a['load_acks']}" for a in acks],
            f"{nc_acks['loads_queued']}/{nc_acks['load_acks']}" if nc else ""),
        row("replay CPU s", summary["cpu_seconds_per_rank"], nc.get("cpu_seconds")),
        row("  in cache calls", summary["cache_cpu_seconds_per_rank"], nc.get("cache_cpu_seconds")),
        row("    in all-reduces", summary["collective_cpu_seconds_per_rank"], nc.get("collective_cpu_seconds")),
        row("  writing/checking KV", summary["content_cpu_seconds_per_rank"], nc.get("content_cpu_seconds")),
        row("startup s (import+build)", summary["startup_seconds_per_rank"], nc.get("startup_seconds")),
        *_optional_rows(summary, row, _BOOKKEEPING_ROWS, "device_evictions_per_rank"),
        *_optional_rows(summary, row, _L3_ROWS, "l3_written_pages_per_rank"),
    ]


#: Rows shown only where the summary has their first key: (label, per-rank key).
#: --l3: each rank's own pages written to and restored from L3 (the non-CP
#: baseline runs without L3).
_L3_ROWS = (
    ("L3 pages written", "l3_written_pages_per_rank"),
    ("L3 hit tokens (restored)", "l3_hit_tokens_per_rank"),
    ("L3 pages verified", "l3_pages_verified_per_rank"),
    ("L3 objects rejected", "l3_rejected_objects_per_rank"),
)
#: 0.5.23: refused backups, hits off the device (host and L3: every rank
#: matches alike), device evictions and host reads of
#: device locs, counted alike on both copy paths (shown when the summary has
#: device_evictions_per_rank).
_BOOKKEEPING_ROWS = (
    ("node backups refused", "write_failures_per_rank"),
    ("host + L3 hit tokens", "host_hit_tokens_per_rank"),
    ("device evictions (nodes)", "device_evictions_per_rank"),
    ("  tokens they freed", "device_eviction_tokens_per_rank"),
    ("host reads of device locs", "device_index_host_reads_per_rank"),
    ("  freeing request pages", "request_free_reads_per_rank"),
)


def _optional_rows(
    summary: dict[str, Any], row: Callable[..., str], rows: tuple[tuple[str, str], ...], shown_by: str
) -> list[str]:
    """``rows`` where ``summary`` has ``shown_by``, else none."""
    if shown_by not in summary:
        return []
    return [row(label, summary[key]) for label, key in rows]


def _library_lines(summary: dict[str, Any]) -> list[str]:
    """0.5.23 library stack: its host room, device frees and warm-up."""
    room = summary.get("host_room")
    if not room:
        return []
    frees = summary["device_frees_per_rank"]
    warm = [w for w in summary["warmup_per_rank"] if w]
    backends = "/".join(sorted({w["backend"] for w in warm})) or "none"
    return [
        f"library host room (every rank): {room['backups']} backups, {room['backups_short']} short; "
        f"{room['leaves_evicted']} host leaves evicted ({room['leaves_evicted_for_ancestors']} on the way to "
        f"an ancestor, {room['pages_evicted']} pages), {room['leaves_skipped']} passed over",
        f"library device frees: from the rotation phase {_ranks_text([f.get('from_phase') for f in frees])} "
        f"evicted nodes, {_ranks_text([f.get('duplicates_from_phase') for f in frees])} insert duplicates, "
        f"{_ranks_text([f.get('request_from_phase') for f in frees])} request frees; "
        f"through upstream's free {_ranks_text([f.get('read_back') for f in frees])}; kernels warmed up at "
        f"build: {backends}, at most {_fmt(max((w['seconds'] for w in warm), default=None))} s a rank",
    ]


def _ranks_text(values: list[Any]) -> str:
    """``v on every rank``, or the values rank by rank."""
    if values and all(v == values[0] for v in values):
        return f"{_fmt(values[0])} on every rank"
    return "[" + ", ".join(_fmt(v) for v in values) + "] by rank"


def _totals_lines(summary: dict[str, Any], nc: dict[str, Any]) -> list[str]:
    """Logical token counts, what was verified, agreement, the copies."""
    tiers = summary["hit_tokens_per_tier"]  # "host hits" means the host tier alone everywhere
    return [
        f"logical tokens: device hits {tiers['device']}, host hits {tiers['host']}, L3 hits {tiers['l3']}, "
        f"loaded back to the device {summary['load_back_tokens']} ({summary['load_backs']} load-backs), "
        f"backed up {summary['backup_tokens']}, device-evicted {summary['device_evicted_tokens']}"
        + (f" (of which {summary['device_reclaimed_tokens']} for host balance)"
           if summary.get("device_reclaimed_tokens") else "") + ", "
        f"load-backs refused {summary['load_backs_refused']}, skipped requests {summary['skipped_requests']}",
        f"pages verified bit-exact: {summary['verified_pages']} "
        f"(of which just restored: {summary['restored_pages_verified']}), "
        f"corrupted: {summary['corrupted_pages']}; indexer pages verified: {summary['indexer_pages_verified']}"
        + (f"; non-CP verified {nc['verified_pages']}, corrupted {nc['corrupted_pages']}" if nc else ""),
        f"ranks agree (tree digest + acks, all_gather): {'yes' if summary['ranks_agree'] else 'NO'}",
        *_l3_line(summary),
        _copies_line(summary["copies"]),
        *_bookkeeping_line(summary),
        *_library_lines(summary),
    ]


def _bookkeeping_line(summary: dict[str, Any]) -> list[str]:
    if "device_evictions" not in summary:
        return []
    return [
        f"bookkeeping: node backups {summary['backups_attempted']}, refused {summary['write_failures']}; "
        f"device evictions {summary['device_evictions']} nodes ({summary['device_eviction_tokens']} tokens)",
        f"host reads of device locs (allocator.free outside a free group: a sync each on a GPU): "
        f"{summary['device_index_host_reads']} over all ranks, "
        f"{sum(summary['request_free_reads_per_rank'])} of them freeing request pages",
    ]


def _l3_line(summary: dict[str, Any]) -> list[str]:
    if "l3_dir" not in summary:
        return []
    line = (f"L3 ({summary['l3_dir']}; CP ranks only): {summary['l3_written_pages']} pages written, "
            f"{summary['l3_hit_tokens']} tokens restored, {summary['l3_pages_verified']} restored pages verified "
            f"bit-exact, {summary['l3_rejected_objects']} objects rejected")
    if "l3_write_failures" in summary:  # summaries from before the loss counters (committed results) lack them
        line += (f"; lost: {summary['l3_write_failures']} page writes failed, {summary['l3_dropped_writes']} "
                 f"dropped, {summary['l3_read_failures']} page reads failed, {summary['l3_timeouts']} lookups "
                 f"timed out")
    return [line]


def _copies_line(copies: dict[str, Any]) -> str:
    if copies["backend"] is None:
        return "copies through sglang_cp_hicache.kernels.transfer: none (another copy path ran them)"
    return (
        f"copies through sglang_cp_hicache.kernels.transfer: backend {copies['backend']}, "
        f"cp_size {copies['cp_size']}; KV backup/load calls {copies['kv_backup_calls']}/"
        f"{copies['kv_load_calls']}, indexer {copies['indexer_backup_calls']}/"
        f"{copies['indexer_load_calls']}, owned pages moved {copies['pages_copied']} (all ranks)"
    )


def _comparison_lines(summary: dict[str, Any], comp: dict[str, Any]) -> list[str]:
    """Host slots, CPU and hits against the non-CP run; then the goals, as
    targets apart from the checks (only the checks decide the result line)."""
    fr = ", ".join(_fmt(f) for f in comp["host_slots_fraction_per_rank"])
    mean_fr = ", ".join(_fmt(f) for f in comp["host_slots_mean_fraction_per_rank"])
    dev = ", ".join(f"{d:+.2f}" for d in comp["host_slots_deviation_pages_per_rank"])
    goals = [f"replay CPU / non-CP <= {CPU_GOAL}: {_met(comp['cpu_goal_met'])}",
             f"cache-call CPU / non-CP <= {CACHE_CPU_GOAL}: {_met(comp['cache_cpu_goal_met'])}"]
    if comp.get("host_slots_goal_met") is not None:  # 0.5.18's exact host balance only
        goals.insert(0, f"0.5.18's exact host balance, every rank's peak within 1 page of 1/{summary['cp_size']}: "
                        f"{_met(comp['host_slots_goal_met'])}")
    return [
        f"peak host slots per rank / non-CP peak: {fr}, i.e. {dev} pages from 1/{summary['cp_size']}; "
        f"time-averaged: {mean_fr}"
        + (f"; host balance: {summary['host_balance']}" if summary.get("host_balance") else ""),
        f"replay CPU s, CP mean per rank / non-CP: {_fmt(comp['cpu_ratio'])}; in cache calls "
        f"{_fmt(comp['cache_cpu_ratio'])} ({_fmt(comp['cache_cpu_ratio_without_collectives'])} without "
        f"all-reduces), KV content {_fmt(comp['content_cpu_ratio'])}",
        f"requests with the same device/host hits and restores as non-CP: "
        f"{comp['requests_with_identical_hits']}/{summary['requests']}",
        f"goals of SGLang {summary['sglang_version']} (targets, not checks: the result line does not depend on "
        "them): " + "; ".join(goals),
    ]


def _result_line(summary: dict[str, Any]) -> str:
    if not summary["ok"]:
        return "result: FAILED: " + "; ".join(summary["problems"])
    if summary.get("nothing_verified"):
        return f"result: OK, but NOTHING WAS VERIFIED: {NOTHING_VERIFIED}"
    return "result: OK"


def _met(goal_met: bool) -> str:
    return "met" if goal_met else "missed"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
