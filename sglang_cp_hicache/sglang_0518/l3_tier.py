"""The L3 (storage) tier of the CP cache on SGLang 0.5.18: one rank's pages
between its host pool and a :class:`~sglang_cp_hicache.l3.PageStore`.

The tier itself is the core's :class:`~sglang_cp_hicache.l3.host_tier.HostL3Tier`
(keys, owned-page stores and fetches, host-pool bytes); this module binds it
to 0.5.18: SGLang's page hash (``get_hash_str``), host slots that are host
rows, the store ``--hicache-storage-backend`` names (file or Mooncake), and
the model identity of the server's arguments.

:func:`open_l3` runs before the CP ranks' start-up agreement and never
raises: an unusable store is this rank's agreement view, raised on every
rank once they have all reached the agreement.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

from sglang.srt.mem_cache.utils import get_hash_str

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.auth import UNKEYED, ObjectSeal, seal_from_settings
from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Counters, L3Snapshot, open_tier_store
from sglang_cp_hicache.l3.host_tier import namespaces as _namespaces  # noqa: F401 (the 0.5.23 tests compare it)
from sglang_cp_hicache.l3.identity import ModelIdentity, identity_of_server_args
from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.rank import L3Opening, open_tier
from sglang_cp_hicache.l3.store import PageStore
from sglang_cp_hicache.l3_backends import SGLangRules, open_page_store
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["L3Counters", "L3Snapshot", "L3Tier", "balanced_owners", "open_l3", "server_identity"]


def balanced_owners(used: list[int], num_pages: int, page_size: int) -> list[int]:
    """Owners for ``num_pages`` restored pages: each page to the rank holding
    the fewest host slots so far (ties: the lowest rank). ``used`` is the
    host ledger, identical on every rank, so every rank picks the same."""
    load = list(used)
    owners = []
    for _ in range(num_pages):
        owner = min(range(len(load)), key=lambda r: (load[r], r))
        owners.append(owner)
        load[owner] += page_size
    return owners


class L3Tier(HostL3Tier):
    """One rank's L3 on 0.5.18's host pools (a host slot is a host row)."""

    def __init__(
        self, store: PageStore, placement: CpPlacement, kv_host: Any, indexer_host: Any, *,
        model_id: str, layer_start: int = 0, model_label: str = "", seal: ObjectSeal = UNKEYED,
    ) -> None:
        super().__init__(store, placement, kv_host, indexer_host, model_id=model_id, page_hasher=get_hash_str,
                         layer_start=layer_start, model_label=model_label, seal=seal)


def storage_tp_size(server_args: Any, cp_size: int) -> int:
    """The TP size SGLang's storage config has (attention TP under DP
    attention): what a Mooncake ``global_segment_size`` is shared by."""
    tp = getattr(server_args, "tp_size", None)
    if not isinstance(tp, int) or tp < 1:
        return cp_size  # the cache used directly (the simulator, tests): its CP ranks
    dp = getattr(server_args, "dp_size", 1)
    if getattr(server_args, "enable_dp_attention", False) and isinstance(dp, int) and dp > 1:
        return max(1, tp // dp)
    return tp


def server_identity(server_args: Any) -> ModelIdentity:
    """The model identity of a server's arguments (the namespace's model)."""
    return identity_of_server_args(server_args, settings.read(settings.L3_MODEL_ID) or None)


def open_l3(
    placement: CpPlacement, targets: Any, device_pool: Any, location: L3Location, source: str,
    identity: Optional[ModelIdentity] = None, server_args: Any = None,
) -> L3Opening:
    """This rank's L3 tier at ``location`` (see the module doc) on the host
    pools of ``targets`` (:class:`~.host_copies.CpCopyTargets`); ``source``
    names what chose the store, in the message of an unusable one."""

    def build() -> L3Tier:
        model = identity if identity is not None else server_identity(server_args)
        rules = SGLangRules("0.5.18", segment_ranks=storage_tp_size(server_args, placement.cp_size),
                            rank=placement.cp_rank)
        store = open_tier_store(partial(open_page_store, mooncake_rules=rules), location.backend,
                                location.directory, location.extra_config, source)
        return L3Tier(
            store, placement, targets.kv_host_pool, targets.indexer_host_pool, model_id=model.text(),
            layer_start=int(getattr(device_pool, "start_layer", 0) or 0), model_label=model.short(),
            seal=seal_from_settings(),
        )

    return open_tier(location, build)
