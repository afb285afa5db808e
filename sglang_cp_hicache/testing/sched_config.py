"""What one real-scheduler harness run is: release, CP size, loop, sizes.

Shared by the parent (the tokenizer / detokenizer side) and the rank
processes; pure data, no SGLang import.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_cp_hicache.testing.sched_worker import PoolShape

__all__ = ["IpcNames", "PdScript", "SchedConfig", "server_args_kwargs"]

_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sched_model")


@dataclass(frozen=True)
class PdScript:
    """How the fake PD sender of ``bootstrap_room`` behaves: it stays in
    bootstrap for ``bootstrap_polls`` polls (the optimistic-prefill branch
    runs meanwhile), then succeeds, or fails: ``fail="bootstrap"`` right
    after those polls, ``fail="transfer"`` once the KV was sent."""

    bootstrap_room: int
    bootstrap_polls: int = 0
    fail: Optional[str] = None

    def __post_init__(self) -> None:
        if self.fail not in (None, "bootstrap", "transfer"):
            raise ValueError(f"fail must be None, 'bootstrap' or 'transfer', got {self.fail!r}")
        if self.bootstrap_polls < 0:
            raise ValueError(f"bootstrap_polls must be >= 0, got {self.bootstrap_polls}")


@dataclass(frozen=True)
class IpcNames:
    """SGLang's ``PortArgs`` as plain data: the parent binds the sockets."""

    tokenizer_ipc_name: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str
    nccl_port: int
    rpc_ipc_name: str
    metrics_ipc_name: str


@dataclass(frozen=True)
class SchedConfig:
    version: str
    cp_size: int = 2
    pd_prefill: bool = False
    overlap: bool = False
    chunked_prefill_size: int = 128
    shape: PoolShape = field(default_factory=PoolShape)
    hicache_ratio: float = 2.0
    l3_dir: Optional[str] = None  # the file L3 backend's directory (None: no L3)
    prefetch_policy: str = "best_effort"
    pd_scripts: tuple[PdScript, ...] = ()
    extra_server_args: tuple[tuple[str, Any], ...] = ()
    # 0.5.23: whose copies the sharded pool runs (SGLANG_CP_HICACHE_COPY in each rank); "upstream" keeps
    # SGLang's own stack, so the library's CP cache is expected off
    copy_path: str = "library"
    batch_timeout_s: float = 120.0  # the most the parent waits for the next event of a busy run
    # Every this many forwards a decode batch retracts requests, memory short or not (SGLang's own
    # retraction test switch, SGLANG_TEST_RETRACT); 0: only when decode memory runs out
    forced_retract_interval: int = 0
    # 0.5.18: host reads of device indices (the request pool's req_to_token and all taken from it)
    # raise while the cache inserts (sched_trap.py)
    trap_insert_reads: bool = False

    def __post_init__(self) -> None:
        if self.version not in ("0.5.18", "0.5.23"):
            raise ValueError(f"version must be '0.5.18' or '0.5.23', got {self.version!r}")
        if not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {self.cp_size!r}")
        if self.version == "0.5.23" and self.cp_size > 1 and not self.pd_prefill:
            # SGLang 0.5.23's page-interleave sharded allocator refuses decode
            raise ValueError("pd_prefill must be True for 0.5.23 with cp_size > 1 (the sharded allocator refuses decode)")
        if self.copy_path not in ("library", "upstream"):
            raise ValueError(f"copy_path must be 'library' or 'upstream', got {self.copy_path!r}")
        if self.copy_path != "library" and self.version != "0.5.23":
            raise ValueError(f"copy_path {self.copy_path!r} needs version '0.5.23' (0.5.18's CP copies are the library's)")
        if not isinstance(self.forced_retract_interval, int) or self.forced_retract_interval < 0:
            raise ValueError(f"forced_retract_interval must be an int >= 0, got {self.forced_retract_interval!r}")
        if self.trap_insert_reads and self.version != "0.5.18":
            raise ValueError("trap_insert_reads needs version '0.5.18' (the inserts it traps are 0.5.18's)")
        if self.chunked_prefill_size % self.shape.page_size:
            raise ValueError(f"chunked_prefill_size must be a multiple of page_size {self.shape.page_size}, "
                             f"got {self.chunked_prefill_size}")

    def script_for(self, room: int) -> Optional[PdScript]:
        return next((s for s in self.pd_scripts if s.bootstrap_room == room), None)


def server_args_kwargs(config: SchedConfig) -> dict[str, Any]:
    """``ServerArgs`` keyword arguments of a CP rank of ``config``."""
    kw: dict[str, Any] = dict(
        model_path=_MODEL_DIR, device="cpu", page_size=config.shape.page_size, enable_hierarchical_cache=True,
        hicache_mem_layout="layer_first", hicache_io_backend="kernel", hicache_ratio=config.hicache_ratio,
        hicache_write_policy="write_through", skip_tokenizer_init=True, load_format="dummy",
        disable_overlap_schedule=not config.overlap, chunked_prefill_size=config.chunked_prefill_size,
        skip_server_warmup=True, max_running_requests=config.shape.max_running_requests, tp_size=config.cp_size,
        disable_cuda_graph=True, sleep_on_idle=True, kv_cache_dtype="fp8_e4m3",
    )
    if config.cp_size > 1:
        kw.update(attn_cp_size=config.cp_size, enable_prefill_cp=True, cp_strategy="interleave")
        if config.version == "0.5.18":
            kw["radix_cache_backend"] = "cp-hicache"
    if config.pd_prefill:
        # 'fake' is refused for a prefill server; the pd-transfer seam maps nixl's classes to SGLang's fake ones
        kw.update(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl")
    if config.l3_dir is not None:
        extra = {"file_storage_path": config.l3_dir, "prefetch_timeout_base": 60.0, "prefetch_timeout_max": 120.0}
        kw.update(hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps(extra),
                  hicache_storage_prefetch_policy=config.prefetch_policy)
    kw.update(dict(config.extra_server_args))
    return kw
