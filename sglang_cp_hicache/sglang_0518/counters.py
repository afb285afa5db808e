"""The CP cache's counters: one object, handed to each collaborator that
counts something (write-through, host tier, load-back)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CpHiCacheCounters"]


@dataclass
class CpHiCacheCounters:
    write_backups: int = 0
    write_failures: int = 0
    host_evicted_nodes: int = 0
    host_evicted_slots: int = 0  # physical, this rank
    load_backs: int = 0
    load_back_tokens: int = 0  # logical
    device_page_reads: int = 0  # inserts without a CPU page mirror (each one a sync)
    lane_reclaim_tokens: int = 0  # device tokens evicted to keep host shares even
    # Monotonic companions for the live metrics (a take-back lowers the counts above):
    write_takebacks: int = 0  # writes taken back at the step's all-reduce
    load_back_takebacks: int = 0  # load-backs taken back at the step's all-reduce
    load_back_takeback_tokens: int = 0  # their logical tokens
    device_page_reads_avoided: int = 0  # inserts whose pages came from the CPU mirror
    load_backs_declined: int = 0  # threshold, quota, or no owner lane room even after evicting
    load_back_declined_tokens: int = 0  # logical host tokens of those
