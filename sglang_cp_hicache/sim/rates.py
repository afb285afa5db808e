"""The run as rates: prompt tokens, hits per tier against the prompt and
against what an infinite cache would hit (:mod:`.ideal`), bytes moved per
tier and direction, GB/s of the copy path, start-up apart from the replay.

Hits are logical tokens matched at the start of each request, as SGLang's
``match_prefix`` reports them (rank 0's; every rank matches alike):

* ``device``: already on the device;
* ``host``: on the host only (``host_hit_tokens``, less what L3 put there
  for this very request);
* ``l3``: brought from L3 to the host for this request by its prefetch.

``hit_tokens`` = device + host + L3 = ``device_hit_tokens`` +
``host_hit_tokens`` (the host figure counts L3's too). ``hit_ratio`` divides
it by ``ideal_hit_tokens``: the same requests on an infinite cache. The
ideal counts this run's requests only, so an L3 directory filled by an
earlier run can take ``hit_ratio`` above 1. ``*_rate`` divides by
``prompt_tokens`` instead.

Bytes: a page is ``page_bytes`` (KV rows + indexer row, every layer) on
every rank; ``host_d2h`` / ``host_h2d`` are the pages each rank copied to and
from its host pool (its own pages only: summed over ranks they are the
logical traffic), ``l3_write`` / ``l3_read`` the pages each rank stored to
and restored from L3. ``copy_gbps`` divides a rank's host bytes by the CPU
seconds its thread spent inside the controller's copy submissions (where
the copies run on CPU; wall seconds, which a busy machine inflates, are in
``copy_wall_seconds_per_rank``): a CPU figure, not a GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_cp_hicache.sim.records import RankReport

__all__ = ["TIERS", "WorkloadFacts", "capacity_fields", "hit_fields", "traffic_fields"]

TIERS = ("device", "host", "l3")


@dataclass
class WorkloadFacts:
    """What the launcher knows of the requests before any rank starts."""

    prompt_tokens: int
    ideal_hit_tokens: list[int]  # per request (:func:`.ideal.ideal_hit_tokens`)
    trace: dict[str, Any] = field(default_factory=dict)  # TraceInfo.as_dict() of a trace


def _share(part: float, whole: float) -> Optional[float]:
    return part / whole if whole else None


def tier_hits(report: RankReport) -> dict[str, int]:
    """Logical hit tokens per tier over one rank's requests."""
    recs = report.records
    l3 = sum(min(r.l3_hit_tokens, r.host_hit_tokens) for r in recs)
    return {
        "device": sum(r.device_hit_tokens for r in recs),
        "host": sum(r.host_hit_tokens for r in recs) - l3,
        "l3": l3,
    }


def hit_fields(facts: WorkloadFacts, rank0: RankReport) -> dict[str, Any]:
    """Prompt tokens, the ideal, hits per tier, their ratios and rates."""
    tiers = tier_hits(rank0)
    hits = sum(tiers.values())
    ideal = sum(facts.ideal_hit_tokens)
    prompt = facts.prompt_tokens
    return {
        **facts.trace,
        "prompt_tokens": prompt,
        "ideal_hit_tokens": ideal,
        "ideal_hit_rate": _share(ideal, prompt),
        "hit_tokens": hits,
        "hit_tokens_per_tier": tiers,
        "hit_ratio": _share(hits, ideal),
        "hit_ratio_per_tier": {t: _share(n, ideal) for t, n in tiers.items()},
        "hit_rate": _share(hits, prompt),
        "hit_rate_per_tier": {t: _share(n, prompt) for t, n in tiers.items()},
    }


def traffic_fields(reports: list[RankReport], page_size: int) -> dict[str, Any]:
    """Bytes per tier and direction (per rank and summed), the copy path's
    wall seconds and GB/s per rank."""
    per_rank = []
    gbps = []
    for r in reports:
        t, page = r.totals, r.page_bytes
        moved = {
            "host_d2h": t.backup_slots // page_size * page,
            "host_h2d": t.load_slots // page_size * page,
            "l3_write": t.l3_written_pages * page,
            "l3_read": t.l3_hit_tokens // page_size * page,
        }
        per_rank.append(moved)
        wall = r.copy_wall
        gbps.append({
            direction: _share(moved[f"host_{direction}"] / 1e9, wall.get(f"{direction}_cpu_seconds", 0.0))
            for direction in ("d2h", "h2d")
        })
    totals = {key: sum(m[key] for m in per_rank) for key in ("host_d2h", "host_h2d", "l3_write", "l3_read")}
    return {
        "page_bytes": reports[0].page_bytes if reports else 0,
        "bytes_moved": totals,
        "bytes_moved_per_rank": per_rank,
        "copy_wall_seconds_per_rank": [r.copy_wall for r in reports],
        "copy_gbps_per_rank": gbps,
        "copy_gbps": {d: _mean([g[d] for g in gbps if g[d] is not None]) for d in ("d2h", "h2d")},
    }


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def capacity_fields(summary: dict[str, Any], non_cp_rank: RankReport) -> dict[str, Any]:
    """The non-CP baseline's hits (N x the pages, no L3) and the CP run's
    hits over them: how much of what N x the capacity in one pool hits the
    sharded cache hits."""
    tiers = tier_hits(non_cp_rank)
    hits = sum(tiers.values())
    return {
        "non_cp_hit_tokens": hits,
        "non_cp_hit_tokens_per_tier": tiers,
        "non_cp_hit_ratio": _share(hits, summary["ideal_hit_tokens"]),
        "capacity_efficiency": _share(summary["hit_tokens"], hits),
    }
