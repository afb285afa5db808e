"""``simulate --compare-upstream`` (SGLang 0.5.23): one workload through
this library's copy path (``--copy library``) and upstream's (``--copy
upstream``), side by side.

:func:`compare_upstream` builds the JSON from the two runs' summaries
(:func:`.report.summarize`), :func:`format_comparison` the text. Each path's
column holds what an operator asks ("does it help me?"): hits per tier
against the ideal, backups lost, host reads of device indices, the L3 tier
(with ``--l3``: upstream refuses any storage tier under KV sharding, so its
run has none), and what the library costs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from sglang_cp_hicache.sim.report import mean

__all__ = ["PATHS", "UPSTREAM_L3_REFUSAL", "compare_upstream", "format_comparison"]

PATHS = ("library", "upstream")
#: Why upstream's run has no L3: its start-up checks for KV sharding
#: (arg_groups/kv_shard_hook.py) refuse --hicache-storage-backend.
UPSTREAM_L3_REFUSAL = ("SGLang 0.5.23 refuses any storage tier (--hicache-storage-backend) under KV sharding "
                       "at start-up; this library lifts that for file and mooncake on its own path")


def _path_figures(s: dict[str, Any]) -> dict[str, Any]:
    """One path's column, read off its summary."""
    tiers = s["hit_tokens_per_tier"]
    reads = s.get("device_index_host_reads_per_rank") or []
    return {
        "hit_tokens_per_tier": dict(tiers),
        "hit_ratio_per_tier": dict(s["hit_ratio_per_tier"]),
        "hit_tokens": s["hit_tokens"],
        "hit_ratio": s["hit_ratio"],
        "backups_attempted": s.get("backups_attempted"),
        "backups_lost": s.get("write_failures"),
        "device_index_host_reads": s.get("device_index_host_reads"),
        "device_index_host_reads_max_per_rank": max(reads) if reads else None,
        "request_free_reads_max_per_rank": max(s.get("request_free_reads_per_rank") or [0]),
        "l3": "l3_dir" in s,
        "l3_written_pages": s.get("l3_written_pages", 0),
        "l3_written_bytes": s["bytes_moved"]["l3_write"],
        "l3_pages_verified": s.get("l3_pages_verified", 0),
        "host_pages_per_rank": s["host_pages"],
        "peak_host_slots_max_per_rank": max(s["host_slots_per_rank"]),
        "replay_cpu_seconds_per_rank": s["cpu_seconds"],
        "cache_cpu_seconds_per_rank": mean(s["cache_cpu_seconds_per_rank"]),
        "replay_wall_seconds": s["replay_wall_seconds"],
        "verified_pages": s["verified_pages"],
        "restored_pages_verified": s["restored_pages_verified"],
        "corrupted_pages": s["corrupted_pages"],
        "ranks_agree": s["ranks_agree"],
        "ok": s["ok"],
    }


def compare_upstream(
    library: dict[str, Any], upstream: dict[str, Any], *, command: Optional[str] = None
) -> dict[str, Any]:
    """The comparison's JSON: the shared workload, one column per path, and
    both full summaries (``runs``)."""
    shared = ("sglang_version", "cp_size", "page_size", "layers", "requests", "seed", "workload",
              "device_pages", "host_pages", "prompt_tokens", "ideal_hit_tokens", "ideal_hit_rate")
    problems = [f"{path}: {p}" for path, s in zip(PATHS, (library, upstream)) for p in s["problems"]]
    return {
        "kind": "compare_upstream",
        "command": command,
        **{k: library.get(k) for k in shared},
        **({"pool_sizing": library["pool_sizing"]} if "pool_sizing" in library else {}),
        "l3_dir": library.get("l3_dir"),
        "upstream_l3": UPSTREAM_L3_REFUSAL if "l3_dir" in library else None,
        "paths": {"library": _path_figures(library), "upstream": _path_figures(upstream)},
        "ok": not problems,
        "problems": problems,
        "runs": {"library": library, "upstream": upstream},
    }


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


#: The table's rows: label and how to read the cell off a path's column.
_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("device hits (of the ideal)", lambda p: f"{_num(p['hit_tokens_per_tier']['device'])} "
                                             f"({_pct(p['hit_ratio_per_tier']['device'])})"),
    ("host hits (of the ideal)", lambda p: f"{_num(p['hit_tokens_per_tier']['host'])} "
                                           f"({_pct(p['hit_ratio_per_tier']['host'])})"),
    ("L3 hits (of the ideal)", lambda p: f"{_num(p['hit_tokens_per_tier']['l3'])} "
                                         f"({_pct(p['hit_ratio_per_tier']['l3'])})" if p["l3"] else "no L3"),
    ("all hits / ideal", lambda p: _num(p["hit_ratio"])),
    ("backups lost (attempted)", lambda p: f"{_num(p['backups_lost'])} ({_num(p['backups_attempted'])})"),
    ("host reads of device locs", lambda p: f"{_num(p['device_index_host_reads_max_per_rank'])} a rank"),
    ("L3 pages written", lambda p: _num(p["l3_written_pages"]) if p["l3"] else "no L3"),
    ("host pool, pages per rank", lambda p: _num(p["host_pages_per_rank"])),
    ("replay CPU s per rank", lambda p: _num(p["replay_cpu_seconds_per_rank"])),
    ("replay wall s (slowest rank)", lambda p: _num(p["replay_wall_seconds"])),
    ("pages verified / corrupted", lambda p: f"{_num(p['verified_pages'])} / {_num(p['corrupted_pages'])}"),
    ("ranks agree", lambda p: _num(p["ranks_agree"])),
)


def format_comparison(c: dict[str, Any]) -> str:
    """The side-by-side text report."""
    paths = c["paths"]
    width, cell = 30, 24
    lines = [
        f"SGLang {c['sglang_version']}: this library's path (--copy library) against upstream's (--copy upstream), "
        f"the same workload: cp_size={c['cp_size']} requests={c['requests']} workload={c['workload']} "
        f"seed={c['seed']}",
        f"per rank: device {c['device_pages']} pages, host {c['host_pages']} pages (both paths)"
        + (f"; {c['pool_sizing']['distinct_pages']:,} distinct pages in the trace, --capacity "
           f"{c['pool_sizing']['capacity']:g}" if c.get("pool_sizing") else ""),
        f"ideal (an infinite cache, starting empty, page-aligned): {_num(c['ideal_hit_tokens'])} of "
        f"{_num(c['prompt_tokens'])} prompt tokens",
        "",
        f"{'':<{width}}" + "".join(f"{name:>{cell}}" for name in PATHS),
        *(f"{label:<{width}}" + "".join(f"{read(paths[name]):>{cell}}" for name in PATHS) for label, read in _ROWS),
        "",
    ]
    if c.get("upstream_l3"):
        lines.append(f"L3 ({c['l3_dir']}): the library's run only; upstream's run has none: {c['upstream_l3']}")
    lib, up = paths["library"], paths["upstream"]
    lines.append(
        f"costs: the same host pool on both paths; the L3 tier writes {lib['l3_written_bytes'] / 1e9:.3f} GB to "
        f"storage; replay CPU s per rank {_num(lib['replay_cpu_seconds_per_rank'])} (library) vs "
        f"{_num(up['replay_cpu_seconds_per_rank'])} (upstream), copies on CPU here (torch reference kernels), "
        "not a GPU server's cost; not measured: GPU copy time, restore latency, a real server"
    )
    lines.append("result: OK (both runs)" if c["ok"] else "result: FAILED: " + "; ".join(c["problems"]))
    return "\n".join(lines)
