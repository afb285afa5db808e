"""Compile (CUDA) or load (interpreter) the four copy kernels at start-up.

Without it the first real backup and the first load-back of a 0.5.23 server
JIT-compile in the middle of serving. The arguments come from the buffers the
library's transfer engine binds on its first copy (the KV anchor's device
layers and host buffer, the indexer's packed device layers), so the kernels
compiled are exactly the ones it will launch.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolName

from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.sglang_0523.copy_engine import kv_host_pool_of

__all__ = ["warm_up_copies", "warmup_arguments"]

logger = logging.getLogger(__name__)


def warmup_arguments(host_pool_group: Any) -> dict[str, Any]:
    """The ``kernels.transfer.warmup`` arguments for a sharded DSA host pool
    group (KV anchor + indexer)."""
    anchor = host_pool_group.anchor_entry.host_pool
    kv_pool = kv_host_pool_of(anchor)
    if kv_pool is None:
        raise TypeError(f"the anchor host pool is {type(anchor).__name__}, not a sharded MLA host pool")
    kv_layer = kv_pool.device_kv_buffers[0]
    index_layer = host_pool_group.entry_map[PoolName.INDEXER].host_pool.packed_device_index_buffers[0]
    return dict(
        page_size=int(anchor.page_size),
        host_layout=host_pool_group.layout,
        num_layers=len(kv_pool.device_kv_buffers),
        kv_dim=int(kv_layer.shape[-1]),
        kv_dtype=kv_layer.dtype,
        indexer_page_bytes=int(index_layer.shape[-1]),
        device=kv_layer.device,
    )


def warm_up_copies(host_pool_group: Any, cp_rank: int, cp_size: int) -> transfer.WarmupReport:
    """Warm the kernels up for ``host_pool_group``'s pools; one log line."""
    report = transfer.warmup(**warmup_arguments(host_pool_group))
    logger.info(
        "sglang-cp-hicache: copy kernels ready on cp_rank %d of %d: backend=%s, %d kernel(s) %s in %.2f s "
        "(cache dir: %s; set TRITON_CACHE_DIR to a persistent directory to skip this on restart)",
        cp_rank, cp_size, report.backend, report.compiled, ",".join(report.ops) or "-", report.seconds,
        report.cache_dir,
    )
    return report
