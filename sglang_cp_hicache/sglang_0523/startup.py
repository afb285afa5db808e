"""The CP ranks' start-up agreement when the library stack is built.

Every CP rank of the sharded stack decides alone from mirrored state: the
logical device and host allocators, the owner of each page, which copies
run, which host pages make room for a backup. Ranks started with different
page sizes, host layouts, pool sizes, copy paths or copy kernels would
diverge silently, and a library rank would wait in this all-gather for a
rank that never joins it. So a rank on ``SGLANG_CP_HICACHE_COPY=upstream``
joins it too (:class:`~.strategy.UpstreamDsaStrategy`) and a mixed
deployment is refused on every rank. When :class:`~.strategy.LibraryDsaStrategy`
builds, every rank calls :func:`agree_at_start_up` once, before the
controller exists: one all-gather over the device pool's shard group (the
group whose ``rank_in_group`` / ``world_size`` gave the pool its
``shard_rank`` / ``shard_size``; upstream asserts both, and DSA KV sharding
requires attention CP > 1, so it is the attention-CP group), then the same
check on every rank (:func:`sglang_cp_hicache.agreement.check_agreement`).

The settings of this library are read here too, and a bad value is part of
the view rather than raised first: a rank that raised before the all-gather
would leave the others waiting in it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import sglang

from sglang_cp_hicache import settings
from sglang_cp_hicache.agreement import (
    COPY_BACKEND_KEY,
    COPY_PATH_KEY,
    HOST_LAYOUT_KEY,
    HOST_POOL_SLOTS_KEY,
    L3_KEY,
    PAGE_SIZE_KEY,
    RankView,
    gather_and_check,
)
from sglang_cp_hicache.kernels.transfer import select_backend

logger = logging.getLogger(__name__)

__all__ = ["COPY_PATH", "HINTS", "HOST_TAIL_KEY", "SETTINGS_KEY", "agree_at_start_up", "start_up_view"]

#: The copy path of a rank that builds the library strategy (a rank on
#: ``SGLANG_CP_HICACHE_COPY=upstream`` takes part as ``upstream``).
COPY_PATH = "library"
#: The view's entry for the host room's tail rule (a rank-local decision
#: every rank must take alike).
HOST_TAIL_KEY = f"host tail rule ({settings.HOST_TAIL.name})"
#: The view's entry for this library's settings: "valid", or the error.
SETTINGS_KEY = "SGLANG_CP_HICACHE_* settings"
#: What a refusal adds for a key the operator sets by a name of its own.
HINTS = {
    COPY_PATH_KEY: f"{settings.COPY.name} sets the copy path",
    # Both namespace digests: a rank without L3, or with another model, dtype
    # or host layout, is refused.
    L3_KEY: "--hicache-storage-backend / SGLANG_CP_HICACHE_L3_DIR set the L3 tier",
}


def _host_tail() -> str:
    try:
        return settings.read(settings.HOST_TAIL)
    except ValueError:
        return "invalid"  # the settings entry names the error


def _settings_problem() -> Optional[str]:
    settings.log_unknown_names(logger)  # a misspelt name reads as unset: warned, never refused
    try:
        settings.check_all()
    except ValueError as exc:
        return str(exc)
    return None


def start_up_view(kvcache: Any, host_pool_group: Any, copy_path: str = COPY_PATH, l3: str = "off") -> RankView:
    """This rank's view: shard rank and size of the device pool, and every
    value the CP ranks must share (the device pool in pages per rank, the
    host pool in slots per rank, its padding page included; ``copy_path``:
    ``library`` or ``upstream``; ``l3``: ``off`` or the tier's namespaces)."""
    if copy_path not in settings.COPY.choices:
        raise ValueError(f"copy_path must be one of {settings.COPY.choices}, got {copy_path!r}")
    page_size = int(kvcache.shard_spec.page_size)
    host = host_pool_group.anchor_entry.host_pool
    return RankView(
        cp_rank=int(kvcache.shard_rank),
        cp_size=int(kvcache.shard_size),
        values={
            "sglang": sglang.__version__,
            PAGE_SIZE_KEY: page_size,
            HOST_LAYOUT_KEY: host_pool_group.layout,
            # Both allocators are mirrored on every rank (logical pages and
            # host slots): their sizes must be equal for their picks to be.
            "device_pages": int(kvcache.size) // page_size,
            HOST_POOL_SLOTS_KEY: int(host.size),
            COPY_PATH_KEY: copy_path,
            COPY_BACKEND_KEY: select_backend(kvcache.device),
            SETTINGS_KEY: _settings_problem() or "valid",
            HOST_TAIL_KEY: _host_tail(),
            L3_KEY: l3,
        },
    )


def agree_at_start_up(
    kvcache: Any,
    host_pool_group: Any,
    *,
    copy_path: str = COPY_PATH,
    l3: str = "off",
    all_gather: Optional[Callable[[list, Any, Any], None]] = None,
) -> list[RankView]:
    """All-gather this rank's view over the pool's shard group and check it
    (:class:`~sglang_cp_hicache.agreement.CpAgreementError` on every rank,
    naming the disagreeing rank and value); then raise this rank's settings
    error, if any (every rank has the same one once they agree)."""
    view = start_up_view(kvcache, host_pool_group, copy_path, l3)
    views = gather_and_check(view, kvcache.shard_group.cpu_group, all_gather=all_gather, hints=HINTS)
    if view.values[SETTINGS_KEY] != "valid":
        raise ValueError(view.values[SETTINGS_KEY])
    return views
