"""Records the simulator passes between rank processes and the launcher.

Plain dataclasses of ints, floats, strings and lists: they travel through a
``multiprocessing`` queue (pickled) and end up in the JSON report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = [
    "AFTER_REPLAY",
    "AckCounts",
    "CopyWall",
    "EngineTotals",
    "Progress",
    "RankFailure",
    "RankReport",
    "RequestRecord",
    "StartupEvent",
]


#: RankFailure.step of a failure after the last request (end-of-run checks, the report).
AFTER_REPLAY = -1


@dataclass
class RequestRecord:
    """What one request did on one rank (all token counts are logical)."""

    index: int
    tokens: int
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # matched on host only (match_prefix's host_hit_length)
    loaded_tokens: int = 0  # restored by load-back (0 if it was refused)
    new_tokens: int = 0  # computed and written by this request
    duplicate_tokens_freed: int = 0  # insert found them already in the tree
    device_tokens_evicted: int = 0  # evicted to make room for this request
    device_tokens_reclaimed: int = 0  # of those, evicted for one lane (CP: keeps host shares even)
    verified_pages: int = 0  # owned prefix pages checked byte by byte (this rank)
    restored_pages_verified: int = 0  # of those, pages that load-back just restored
    corrupted_pages: int = 0
    l3_pages_verified: int = 0  # of the restored ones, pages whose host copy came from L3 (first load)
    l3_hit_tokens: int = 0  # logical tokens L3 put on the host for this request (part of host_hit_tokens)
    host_slots: int = 0  # physical host slots in use after the request (this rank)
    skipped: bool = False  # did not fit on the device even after eviction


@dataclass
class CopyWall:
    """Seconds inside the controller's L2 copy submissions (device to host,
    host to device) and how many; on CPU a submission runs its copies on
    the calling thread before it returns. ``*_seconds`` is wall time,
    ``*_cpu_seconds`` that thread's CPU time (what the copies cost, however
    busy the machine is)."""

    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    d2h_cpu_seconds: float = 0.0
    h2d_cpu_seconds: float = 0.0
    d2h_calls: int = 0
    h2d_calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class AckCounts:
    """Transfer operations queued and acks consumed by one rank."""

    writes_queued: int = 0
    loads_queued: int = 0
    write_acks: int = 0
    load_acks: int = 0

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.writes_queued, self.loads_queued, self.write_acks, self.load_acks)


@dataclass
class EngineTotals:
    """End-of-run state of one rank's cache."""

    backup_tokens: int = 0  # logical tokens of the nodes backed up
    backup_slots: int = 0  # physical host slots written by this rank
    write_backups: int = 0  # nodes backed up
    write_failures: int = 0  # node backups refused (0.5.23: the cache's _execute_kv_backup returned None)
    host_evicted_slots: int = 0  # physical, this rank
    host_evicted_nodes: int = 0
    load_backs: int = 0
    load_back_tokens: int = 0  # logical
    load_slots: int = 0  # physical slots restored by this rank
    zero_owned_writes: int = 0
    zero_owned_loads: int = 0
    device_page_reads: int = 0  # CP inserts without the CPU page mirror (each a device read)
    lane_reclaims: int = 0  # CP allocator: evictions for a lane that was short
    uneven_picks: int = 0  # CP allocator: pages placed off balance (nothing to reclaim)
    host_balance: str = ""  # CP cache: SGLANG_CP_HICACHE_HOST_BALANCE policy (exact | greedy)
    host_slot_capacity: int = 0  # physical, this rank
    # 0.5.18 CP with --l3 (the cache's cp_l3 counters; all 0 without L3):
    l3_enabled: bool = False
    l3_written_pages: int = 0  # own pages this rank stored (KV + indexer objects both)
    l3_hit_tokens: int = 0  # own tokens this rank put into its host pool from L3
    l3_rejected_objects: int = 0  # own objects found but refused (checksum, length, namespace)
    l3_restored_keys: list[str] = field(default_factory=list)  # page keys of the own pages restored from L3
    l3_stored_keys: list[str] = field(default_factory=list)  # page keys of the own pages left whole in L3
    # what the L3 lost (a store gone, a master restarted): own pages whose put failed or was dropped,
    # own pages found present but not read whole (gone since, a failed transfer, refused), lookups timed out
    l3_write_failures: int = 0
    l3_dropped_writes: int = 0
    l3_read_failures: int = 0
    l3_timeouts: int = 0
    # 0.5.23 (both copy paths, counted the same way on each):
    backups_attempted: int = 0  # calls of the cache's _execute_kv_backup
    device_evictions: int = 0  # tree nodes whose device value was evicted (FULL component)
    device_eviction_tokens: int = 0  # tokens those evictions freed, as SGLang's component reports them
    device_index_host_reads: int = 0  # allocator.free calls that read device locs on the host
    request_free_reads: int = 0  # of those, the simulated scheduler's frees of a request's own pages
    # 0.5.23 library stack only (empty on upstream's): the controller's counters.
    host_room: dict[str, int] = field(default_factory=dict)  # owner-aware host room
    device_frees: dict[str, int] = field(default_factory=dict)  # from_phase / read_back
    warmup: dict[str, Any] = field(default_factory=dict)  # kernels warmed up at build: backend, seconds
    tree_digest: str = ""
    invariant_violations: list[str] = field(default_factory=list)


@dataclass
class RankReport:
    """Everything one rank (or the non-CP process, ``rank == -1``) sends back."""

    rank: int
    cp_size: int
    cp_mode: bool
    records: list[RequestRecord]
    totals: EngineTotals
    acks: AckCounts
    cpu_seconds: float  # process CPU seconds of the replay (after import and build)
    cache_cpu_seconds: float  # of which inside SGLang cache / allocator calls
    content_cpu_seconds: float  # of which writing and verifying content
    collective_cpu_seconds: float  # of the cache part, inside the cache's consensus all-reduce
    collective_calls: int
    wall_seconds: float
    startup_seconds: float  # wall: import + process group + stack build
    agreement: Optional[dict[str, Any]] = None  # rank 0 only: the all_gather verdict
    copies: dict[str, Any] = field(default_factory=dict)  # kernels.transfer.copy_stats() of the replay
    indexer_pages_verified: int = 0  # owned pages whose indexer bytes were checked too
    copy_path_cpu: dict[str, Any] = field(default_factory=dict)  # 0.5.23: CPU s in the sharded copy path
    page_bytes: int = 0  # bytes of one page on this rank: KV rows + indexer row, every layer
    copy_wall: dict[str, Any] = field(default_factory=dict)  # CopyWall.as_dict(): wall s in the L2 copies
    metrics: dict[str, Any] = field(default_factory=dict)  # --metrics: scrape_library_metrics() of this rank

    @property
    def peak_host_slots(self) -> int:
        return max((r.host_slots for r in self.records), default=0)


@dataclass
class StartupEvent:
    """A process reached a start-up phase (progress.STARTUP_PHASES)."""

    rank: int
    phase: str


@dataclass
class Progress:
    rank: int
    done: int
    total: int


@dataclass
class RankFailure:
    rank: int
    step: Optional[int]  # request index being served, None before the replay, AFTER_REPLAY after it
    error: str  # "ExceptionType: message"
    traceback: str
    at: float = 0.0  # time.monotonic() when it failed (one clock for every process on a Linux host)
