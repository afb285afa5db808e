"""The summary (JSON) and verdict of a ``simulate --engine scheduler`` run,
with the loop engine's names where a figure means the same.

Hits per tier come from what the scheduler really forwarded: a request's
first batch starts at its cached prefix (``prefix_len``), of which the
tokens rank 0's cache loaded back for it up to then came from host; the
rest was a device hit. With ``--l3``, the tail of those host tokens that
SGLang's storage hit on the request names (what the cache's L3 lookup for
that request restored into the host tree) is an L3 hit instead; the
forward stand-in counts each rank's checked rows of it, which must add up
to the L3 hit tokens. A host hit the cache declined (``init_load_back`` loading
0 tokens) is recomputed and counts in ``load_back_declined_tokens``, not in
the hits. SGLang loads back before its last admission checks (chunk and
tile budgets), so a request can be turned away after a load-back and its
loaded pages evicted before it runs; tokens loaded back beyond what its
first batch started from count in ``load_back_unused_tokens``. Corruption cannot be counted, only found: the forward stand-in
fails the run at the first prefix row that does not hold its content, so a
summary exists only for a run with none (``corrupted_pages`` 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.engine_scheduler import ARRIVALS, L3_PREFETCH_POLICY, EngineOptions, SchedulerReplay
from sglang_cp_hicache.sim.rates import WorkloadFacts
from sglang_cp_hicache.sim.report import NOTHING_VERIFIED

__all__ = ["format_scheduler_table", "summarize_scheduler"]


def _share(part: float, whole: float) -> Optional[float]:
    return part / whole if whole else None


@dataclass(frozen=True)
class _First:
    """A request's first forwarded batch: its step, the request's prefix
    there, and the tail of that prefix restored from L3 for it."""

    step: int
    prefix: int
    l3: int


def _first_batches(replay: SchedulerReplay) -> dict[str, _First]:
    first: dict[str, _First] = {}
    for batch in replay.run.batches:
        for entry in batch.entries:
            if entry.rid not in first:
                first[entry.rid] = _First(batch.step, entry.prefix_len, entry.l3_tokens)
    return first


def _tiers(replay: SchedulerReplay) -> tuple[dict[str, int], int, list[str]]:
    """Hit tokens per tier, tokens loaded back that the request's first
    batch did not start from, and any request whose figures do not add up.

    SGLang loads back before its last admission checks (chunk and tile
    budgets): a request turned away after its load-back keeps nothing
    locked, runs in a later batch, and by then its loaded pages may have
    been evicted. So a request's host tokens are those loaded back up to its
    first batch, at most that batch's prefix; the rest are unused. A
    load-back in the batch's own round must fit inside its prefix.

    Of a request's host tokens, the L3 tier has the tail its first batch's
    report names (:class:`~sglang_cp_hicache.testing.sched_forward.BatchEntry`
    ``l3_tokens``: SGLang's storage hit on the request, which the cache sets
    to the tokens its L3 lookup for that request restored into the host
    tree, at most what was loaded back). It must fit in the host tokens."""
    first = _first_batches(replay)
    loaded: dict[str, int] = {}
    in_round: dict[str, int] = {}
    none = _First(-1, 0, 0)
    for lb in replay.run.ranks[0].load_backs:
        step = first.get(lb.rid, none).step
        if lb.step <= step:  # after the first batch: a retracted request admitted again
            loaded[lb.rid] = loaded.get(lb.rid, 0) + lb.loaded_tokens
        if lb.step == step:
            in_round[lb.rid] = in_round.get(lb.rid, 0) + lb.loaded_tokens
    problems = [f"request {rid} loaded back {n} tokens in its first batch's round but started it at prefix "
                f"{first[rid].prefix}" for rid, n in in_round.items() if n > first[rid].prefix]
    host_of = {rid: min(n, first[rid].prefix) for rid, n in loaded.items()}
    problems += [f"request {rid} started from {f.l3} L3 tokens but only {host_of.get(rid, 0)} came from host"
                 for rid, f in first.items() if f.l3 > host_of.get(rid, 0)]
    host = sum(host_of.values())
    l3 = sum(f.l3 for f in first.values())
    device = sum(f.prefix for f in first.values()) - host
    return {"device": device, "host": host - l3, "l3": l3}, sum(loaded.values()) - host, problems


def _retracted(replay: SchedulerReplay) -> int:
    """Requests prefilled again after they had decoded (SGLang retracted them)."""
    decoded: set[str] = set()
    again: set[str] = set()
    for batch in replay.run.batches:
        for entry in batch.entries:
            if batch.mode == "DECODE":
                decoded.add(entry.rid)
            elif entry.rid in decoded:
                again.add(entry.rid)
    return len(again)


def _outcomes(replay: SchedulerReplay) -> tuple[int, int, list[str]]:
    """(finished by length, aborted on purpose, problems: requests that ended otherwise)."""
    finished = aborted = 0
    problems = []
    for rid in replay.rids:
        out = replay.run.outputs.get(rid)
        kind = out.finish_type if out is not None else None
        if kind == "abort" and rid in replay.aborted_on_purpose:
            aborted += 1
        elif kind == "length" or (kind is not None and rid in replay.aborted_on_purpose):
            finished += 1  # an abort that came after the request's last batch changes nothing
        else:
            problems.append(f"request {rid} ended {kind!r}")
    return finished, aborted, problems


def summarize_scheduler(config: SimConfig, opts: EngineOptions, workload: str, replay: SchedulerReplay,
                        facts: WorkloadFacts, *, allow_unverified: bool = False) -> dict[str, Any]:
    """The run's summary; ``ok`` and ``problems`` say whether it passed."""
    run, ranks = replay.run, replay.run.ranks
    tiers, unused_load_back, problems = _tiers(replay)
    finished, aborted, ended = _outcomes(replay)
    problems += ended[:20] + ([f"... and {len(ended) - 20} more"] if len(ended) > 20 else [])
    hits = sum(tiers.values())
    ideal = sum(facts.ideal_hit_tokens)
    prompt = facts.prompt_tokens
    verified_tokens = sum(r.stats.verified for r in ranks)
    declined = run.load_back_declined_tokens()
    summary: dict[str, Any] = {
        "engine": "scheduler",
        # which cache SGLang built (at CP 1 on 0.5.18: stock HiRadixCache, the baseline)
        "tree_cache": run.ready[0].tree_cache if run.ready else None,
        "sglang_version": config.sglang_version,
        "copy_path": config.copy_path,
        "cp_size": config.cp_size, "page_size": config.page_size, "layers": config.num_layers,
        "requests": len(replay.rids), "seed": config.seed,
        "device_pages": config.device_pages, "host_pages": config.host_pages, "workload": workload,
        "event_loop": sorted({loop for r in ranks for loop in r.loops}),
        "max_running_requests": opts.max_running_requests,
        "chunked_prefill_size": opts.chunked_prefill_size,
        "in_flight": opts.window, "max_new_tokens": opts.max_new_tokens, "arrivals": ARRIVALS,
        **facts.trace,
        "prompt_tokens": prompt, "ideal_hit_tokens": ideal, "ideal_hit_rate": _share(ideal, prompt),
        "hit_tokens": hits, "hit_tokens_per_tier": tiers, "hit_ratio": _share(hits, ideal),
        "hit_ratio_per_tier": {t: _share(n, ideal) for t, n in tiers.items()},
        "hit_rate": _share(hits, prompt),
        "device_hit_tokens": tiers["device"], "host_hit_tokens": tiers["host"], "l3_hit_tokens": tiers["l3"],
        "batches": len(run.batches),
        "extend_batches": ranks[0].stats.extend_batches, "decode_batches": ranks[0].stats.decode_batches,
        "chunks": sum(1 for b in run.batches if b.chunked_rid is not None),
        "retracted": _retracted(replay),
        "max_batch_requests": max((len(b.entries) for b in run.batches), default=0),
        "load_backs": sum(1 for lb in ranks[0].load_backs if lb.loaded_tokens > 0),
        "load_back_tokens": tiers["host"] + tiers["l3"] + unused_load_back,
        "load_backs_declined": sum(1 for lb in ranks[0].load_backs if lb.loaded_tokens == 0),
        "load_back_declined_tokens": declined,
        "load_back_unused_tokens": unused_load_back,
        "finished": finished, "aborted": aborted,
        # every hit page was checked on its owner before the request's first forward (the loop engine's
        # meaning); verified_tokens counts every check, a chunked request's prefix again at each chunk
        "verified_tokens": verified_tokens, "verified_pages": hits // config.page_size,
        # host and L3 hits alike reached the device through a load-back
        "restored_pages_verified": (tiers["host"] + tiers["l3"]) // config.page_size,
        "written_tokens": sum(r.stats.written for r in ranks),
        "corrupted_pages": 0, "nothing_verified": verified_tokens == 0,
        "ranks_agree": True,  # every batch was the same on every rank, or the run failed
        "idle_checks_per_rank": [r.idle_checks for r in ranks],
        "library_counters_per_rank": [r.counters for r in ranks],
        "free_device_tokens_at_end": [r.free_device_tokens for r in ranks],
        "evictable_tokens_at_end": [r.evictable_tokens for r in ranks],
        "startup_wall_seconds": round(replay.startup_seconds, 3),
        "replay_wall_seconds": round(replay.replay_seconds, 3),
        "run_wall_seconds": round(run.wall_s, 3),
    }
    if opts.l3_dir is not None:
        summary.update(_l3_fields(config, opts, replay, tiers["l3"], problems))
    if any(n == 0 for n in summary["idle_checks_per_rank"]):
        problems.append(f"a rank never ran SGLang's idle leak checks: {summary['idle_checks_per_rank']}")
    if verified_tokens == 0 and not allow_unverified:
        problems.append(NOTHING_VERIFIED)
    summary["leak_checks_clean"] = True  # strict idle checks raise in the rank on a leak, failing the run
    summary["ok"] = not problems
    summary["problems"] = problems
    return summary


def _l3_fields(config: SimConfig, opts: EngineOptions, replay: SchedulerReplay, l3_hits: int,
               problems: list[str]) -> dict[str, Any]:
    """--l3: what each rank wrote to and restored from L3 (own pages: the
    totals are sums), and the rows of L3 hits the forward checked on their
    owners; ``problems`` gets what does not add up."""
    ranks = replay.run.ranks
    page = config.page_size
    counters = [r.l3_counters for r in ranks]

    def per_rank(name: str) -> list[int]:
        return [c.get(name, 0) for c in counters]

    # every row of an L3 hit is owned by exactly one rank, which checked it before the request's first forward
    verified_rows = [r.stats.l3_verified for r in ranks]
    fields: dict[str, Any] = {
        "l3_dir": opts.l3_dir, "l3_backend": "file", "l3_prefetch_policy": L3_PREFETCH_POLICY,
        "l3_written_pages": sum(per_rank("written_pages")), "l3_written_pages_per_rank": per_rank("written_pages"),
        "l3_kept_pages_per_rank": per_rank("kept_pages"),
        # logical tokens the ranks' lookups inserted into the host trees (every rank alike); the hits are the
        # part of them requests started from
        "l3_restored_tokens_per_rank": per_rank("restored_tokens"),
        "l3_restored_pages_per_rank": per_rank("restored_pages"),
        "l3_pages_verified": sum(verified_rows) // page,
        "l3_pages_verified_per_rank": [n // page for n in verified_rows],
        "l3_rejected_objects": sum(per_rank("rejected_pages")),
        "l3_rejected_objects_per_rank": per_rank("rejected_pages"),
        **{f"l3_{name}": sum(per_rank(name)) for name in ("write_failures", "dropped_writes", "timeouts")},
        # own pages found present whose read did not bring them whole
        "l3_read_failures": sum(r.l3_read_failures for r in ranks),
        "l3_kept_pages": sum(per_rank("kept_pages")),
        # bytes of the own pages written (new or repaired, as l3_written_pages and the loop engine count them);
        # the L3 meter's written bytes also count pages found sound there and left alone (kept)
        "l3_written_bytes": sum(c.get("written_pages", 0) * r.l3_page_bytes for c, r in zip(counters, ranks)),
        "l3_written_or_kept_bytes": int(sum(r.l3_io.get("written_bytes", 0) for r in ranks)),
        # page bytes fetched, every rank's own (as each rank's L3 metered them once its last writes landed)
        "l3_read_bytes": int(sum(r.l3_io.get("read_bytes", 0) for r in ranks)),
        "l3_prefetches": max(per_rank("prefetches"), default=0),
        "l3_counters_per_rank": counters,
    }
    if any(not c for c in counters):
        problems.append("a rank reported no library L3 counters: the library's L3 did not serve it")
    if sum(verified_rows) != l3_hits:
        problems.append(f"{l3_hits} L3 hit tokens, but the ranks checked {sum(verified_rows)} of their rows")
    restored = max(per_rank("restored_tokens"), default=0)
    if l3_hits > restored:
        problems.append(f"{l3_hits} L3 hit tokens, more than the {restored} tokens restored from L3")
    return fields


def format_scheduler_table(summary: dict[str, Any]) -> str:
    """The key figures, one per line."""
    ratio = summary["hit_ratio"]
    rows = [
        ("engine", f"scheduler ({', '.join(summary['event_loop'])}), SGLang {summary['sglang_version']}, "
                   f"copy {summary['copy_path']}, CP {summary['cp_size']}, {summary['tree_cache']}"),
        ("requests", f"{summary['requests']} ({summary['finished']} finished, {summary['aborted']} aborted), "
                     f"{summary['prompt_tokens']:,} prompt tokens"),
        ("batches", f"{summary['batches']} ({summary['chunks']} carried a chunk, up to "
                    f"{summary['max_batch_requests']} requests)"),
        ("hits", f"device {summary['device_hit_tokens']:,} + host {summary['host_hit_tokens']:,} + L3 "
                 f"{summary['l3_hit_tokens']:,} of ideal "
                 f"{summary['ideal_hit_tokens']:,} (hit_ratio {'-' if ratio is None else f'{ratio:.3f}'})"),
        *([("l3", f"{summary['l3_hit_tokens']:,} hit tokens ({summary['l3_pages_verified']} pages checked on "
                  f"their owners), {summary['l3_written_pages']} pages written, {summary['l3_rejected_objects']} "
                  f"rejected")] if "l3_dir" in summary else []),
        ("load-backs", f"{summary['load_backs']} ({summary['load_back_tokens']:,} tokens), declined "
                       f"{summary['load_backs_declined']} ({summary['load_back_declined_tokens']:,} tokens), "
                       f"unused {summary['load_back_unused_tokens']:,} tokens"),
        ("verified", f"{summary['verified_tokens']:,} prefix rows on their owners, 0 corrupted; idle leak checks "
                     f"{summary['idle_checks_per_rank']}"),
        ("wall", f"start-up {summary['startup_wall_seconds']:.0f}s, replay {summary['replay_wall_seconds']:.0f}s"),
        ("ok", "yes" if summary["ok"] else "NO: " + "; ".join(summary["problems"])),
    ]
    return "\n".join(f"{k:>11}  {v}" for k, v in rows)
