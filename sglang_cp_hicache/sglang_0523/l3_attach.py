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
from typing import Any, Optional

from sglang.srt.mem_cache.hicache_storage import PoolName

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.auth import seal_from_settings
from sglang_cp_hicache.l3.identity import ModelIdentity, identity_of_server_args
from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.rank import L3Opening, RankL3, open_tier
from sglang_cp_hicache.l3_backends import SGLangRules
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523.copy_engine import kv_host_pool_of
from sglang_cp_hicache.sglang_0523.l3_cache import L3Driver
from sglang_cp_hicache.sglang_0523.l3_metrics import install_metrics
from sglang_cp_hicache.sglang_0523.l3_port import L3Port0523
from sglang_cp_hicache.sglang_0523.l3_tier import L3Tier

__all__ = ["L3Opening", "check_served_here", "install_l3", "open_l3", "served_here", "server_identity"]

#: The stores this adapter opens (through ``l3_backends.open_page_store``),
#: as the 0.5.18 adapter does.
SERVED_BACKENDS = ("file", "mooncake")

logger = logging.getLogger(__name__)


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


def storage_ranks(server_args: Any, cp_size: int) -> int:
    """The ranks a Mooncake ``global_segment_size`` is shared by, as SGLang
    0.5.23 shares it: its storage config's TP size (attention TP under DP
    attention) times the PP size."""
    tp, pp = getattr(server_args, "tp_size", None), getattr(server_args, "pp_size", 1)
    if not isinstance(tp, int) or tp < 1:
        return cp_size  # the cache used directly (the simulator, tests): its CP ranks
    dp = getattr(server_args, "dp_size", 1)
    if getattr(server_args, "enable_dp_attention", False) and isinstance(dp, int) and dp > 1:
        tp = max(1, tp // dp)
    return tp * (pp if isinstance(pp, int) and pp >= 1 else 1)


def server_identity(server_args: Any) -> ModelIdentity:
    """The model identity of a server's arguments (the namespace's model)."""
    return identity_of_server_args(server_args, settings.read(settings.L3_MODEL_ID) or None)


def open_l3(
    location: L3Location, host_pool_group: Any, *, server_args: Any = None, layer_start: int,
    identity: Optional[ModelIdentity] = None,
) -> L3Opening:
    """This rank's L3 on ``host_pool_group`` (never raises: see :class:`L3Opening`)."""

    def build() -> L3Tier:
        model = identity if identity is not None else server_identity(server_args)
        anchor = host_pool_group.anchor_entry.host_pool
        placement = CpPlacement(anchor.page_size, anchor.shard_size, anchor.shard_rank)
        kv_host = kv_host_pool_of(anchor)
        indexer_host = host_pool_group.entry_map[PoolName.INDEXER].host_pool
        rules = SGLangRules("0.5.23", segment_ranks=storage_ranks(server_args, placement.cp_size), rank=placement.cp_rank)
        return L3Tier.open(
            location.directory, _source_text(location), placement, kv_host, indexer_host,
            backend=location.backend, extra_config=location.extra_config, model_id=model.text(),
            layer_start=layer_start, model_label=model.short(), mooncake_rules=rules, seal=seal_from_settings(),
        )

    return open_tier(location, build)


def install_l3(cache: Any, tier: L3Tier, location: L3Location, host_room: Any, *,
               enable_metrics: bool = False) -> L3Driver:
    """Put the L3 driver on ``cache`` (the scheduler's storage calls);
    ``enable_metrics`` (``--enable-metrics``): SGLang's storage metrics and
    the library's counters, fed by this L3 (:mod:`.l3_metrics`)."""
    port = L3Port0523(cache, tier, host_room)
    driver = L3Driver(cache, RankL3(tier, port, location), port)
    driver.install()
    if enable_metrics:
        install_metrics(cache, driver.l3, port, tier.placement, location.backend if location.scheduler_driven else None)
    timeouts = location.timeouts
    logger.info(
        "sglang-cp-hicache: L3 in %s (%s; model %s; %s), deadline %.1f s + %.2f s per 1024 tokens (at most "
        "%.0f s), cp_rank %d of %d writes and reads its own pages",
        _where(location), _source_text(location), tier.model_label, tier.describe(), timeouts.base_s,
        timeouts.per_ki_token_s, timeouts.max_s, tier.placement.cp_rank, tier.placement.cp_size,
    )
    return driver
