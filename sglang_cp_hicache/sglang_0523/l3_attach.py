"""Opening the library's L3 for the sharded DSA stack (SGLang 0.5.23), and
putting its driver on the cache.

Where L3 lives is one rule for both releases (:func:`sglang_cp_hicache.l3.location.l3_location`):
``--hicache-storage-backend file`` (in SGLang's file-backend directory) or
``SGLANG_CP_HICACHE_L3_DIR``; ``--hicache-storage-backend mooncake`` (a
Mooncake store configured from ``--hicache-storage-backend-extra-config``).
The strategy opens it after the host pools are built and before the CP
ranks' start-up agreement, which then includes both namespace digests: a
rank without L3, or with another model, dtype, row format, layer range or
layout, is refused on every rank. An unusable store becomes this rank's
view too, and is raised after the agreement, so no rank is left waiting in
the all-gather.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.mem_cache.hicache_storage import PoolName

from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.copy_engine import kv_host_pool_of
from sglang_cp_hicache.sglang_0523.l3_cache import L3Driver
from sglang_cp_hicache.sglang_0523.l3_tier import L3Tier

__all__ = ["L3Opening", "check_served_here", "install_l3", "open_l3", "served_here"]

#: The stores this adapter opens (through ``l3_backends.open_page_store``),
#: as the 0.5.18 adapter does.
SERVED_BACKENDS = ("file", "mooncake")

logger = logging.getLogger(__name__)


@dataclass
class L3Opening:
    """The L3 of one rank: ``tier`` (None: off or unusable), ``view`` (its
    start-up agreement value: ``off``, the namespaces, or the problem) and
    ``error`` (raised once the ranks agree)."""

    location: L3Location
    tier: Optional[L3Tier] = None
    view: str = "off"
    error: Optional[Exception] = None


def served_here(location: L3Location) -> bool:
    """Whether this adapter serves the store ``location`` names."""
    return getattr(location, "backend", "file") in SERVED_BACKENDS


def check_served_here(location: L3Location) -> None:
    """Refuse, naming the flag, a store this adapter does not serve (rather
    than running without the L3 the user asked for)."""
    if not served_here(location):
        raise ValueError(
            f"--hicache-storage-backend {getattr(location, 'backend', None)!r} is not served by "
            f"sglang-cp-hicache's SGLang 0.5.23 adapter: use one of {', '.join(SERVED_BACKENDS)}"
        )


def _source_text(location: L3Location) -> str:
    if not location.scheduler_driven:
        return location.source
    if location.backend == "file":
        return f"--hicache-storage-backend file (directory from {location.source})"
    return f"--hicache-storage-backend {location.backend} (settings from {location.source})"


def _where(location: L3Location) -> str:
    return location.directory if location.backend == "file" else f"a {location.backend} store"


def open_l3(location: L3Location, host_pool_group: Any, *, model_id: Optional[str], layer_start: int) -> L3Opening:
    """This rank's L3 on ``host_pool_group`` (never raises: see :class:`L3Opening`)."""
    if not location.enabled:
        return L3Opening(location)
    try:
        if not model_id:
            raise ValueError("L3 needs a model id (--served-model-name or --model-path)")
        anchor = host_pool_group.anchor_entry.host_pool
        layout = CpPlacement(anchor.page_size, anchor.shard_size, anchor.shard_rank)
        kv_host = kv_host_pool_of(anchor)
        indexer_host = host_pool_group.entry_map[PoolName.INDEXER].host_pool
        tier = L3Tier.open(
            location.directory, _source_text(location), layout, kv_host, indexer_host,
            backend=location.backend, extra_config=location.extra_config, model_id=model_id,
            layer_start=layer_start,
        )
    # ImportError, RuntimeError: a store client missing or refusing to start
    # (Mooncake) is this rank's view too, raised only after the agreement.
    except (ValueError, TypeError, AttributeError, KeyError, ImportError, RuntimeError) as exc:
        return L3Opening(location, None, f"unusable: {exc}", exc)
    return L3Opening(location, tier, tier.describe())


def install_l3(cache: Any, tier: L3Tier, location: L3Location) -> L3Driver:
    """Put the L3 driver on ``cache`` (the scheduler's storage calls)."""
    driver = L3Driver(cache, tier)
    driver.install()
    logger.info(
        "sglang-cp-hicache: L3 in %s (%s; %s), cp_rank %d of %d writes and reads its own pages",
        _where(location), _source_text(location), tier.describe(), tier.layout.cp_rank, tier.layout.cp_size,
    )
    return driver
