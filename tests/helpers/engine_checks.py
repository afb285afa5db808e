"""Checks on a ``simulate --engine scheduler`` summary, shared by both releases' tests."""

from __future__ import annotations

from typing import Any

#: Fields the scheduler engine adds to the simulator's summary.
ENGINE_FIELDS = ("engine", "batches", "chunks", "load_backs", "load_back_declined_tokens", "load_back_unused_tokens",
                 "aborted")
#: The simulator summary's names the scheduler engine keeps.
SHARED_FIELDS = ("hit_tokens_per_tier", "ideal_hit_tokens", "hit_ratio", "corrupted_pages", "verified_pages",
                 "ranks_agree", "ok", "problems", "prompt_tokens", "device_hit_tokens", "host_hit_tokens")


def check_scheduler_summary(s: dict[str, Any], *, version: str, requests: int, loop: str) -> None:
    """A scheduler-engine summary: fields present, checks passed, hits within the ideal, every host hit
    the scheduler asked for loaded back."""
    missing = [k for k in ENGINE_FIELDS + SHARED_FIELDS if k not in s]
    assert not missing, missing
    assert s["engine"] == "scheduler" and s["sglang_version"] == version and s["event_loop"] == [loop], s
    assert s["ok"] and s["problems"] == [] and s["corrupted_pages"] == 0 and s["ranks_agree"], s["problems"]
    assert s["finished"] == requests and s["aborted"] == 0, (s["finished"], s["aborted"])
    tiers = s["hit_tokens_per_tier"]
    assert s["hit_tokens"] == tiers["device"] + tiers["host"] + tiers["l3"] > 0, tiers
    # concurrency can only lose hits against one request at a time on an infinite cache
    assert s["hit_tokens"] <= s["ideal_hit_tokens"], (s["hit_tokens"], s["ideal_hit_tokens"])
    assert s["host_hit_tokens"] + s["l3_hit_tokens"] + s["load_back_unused_tokens"] == s["load_back_tokens"], s
    assert s["load_backs"] + s["load_backs_declined"] > 0, "the scheduler asked for no load-back"
    assert s["load_back_declined_tokens"] == 0 and s["load_backs"] > 0, s
    # every hit page was checked on its owner before its first forward; chunks check their prefix again
    assert s["verified_pages"] == s["hit_tokens"] // s["page_size"] and s["verified_tokens"] >= s["hit_tokens"]
    assert s["restored_pages_verified"] == (s["host_hit_tokens"] + s["l3_hit_tokens"]) // s["page_size"]
    # the run was the real scheduler's: several requests in one batch, chunks of a long one
    assert s["max_batch_requests"] > 1 and s["chunks"] > 0 and s["batches"] > s["chunks"], s
    assert min(s["idle_checks_per_rank"]) > 0 and len(s["idle_checks_per_rank"]) == s["cp_size"], s
