"""The L3 (storage) tier of the KV-sharded DSA stack on SGLang 0.5.23: one
rank's pages between its host pools and a :class:`~sglang_cp_hicache.l3.PageStore`.

The tier itself is the core's :class:`~sglang_cp_hicache.l3.host_tier.HostL3Tier`;
this module binds it to 0.5.23: SGLang's page hash (``get_hash_str``), the
store ``--hicache-storage-backend`` names (file or Mooncake), and host slots
that are LOGICAL (identical on every rank): logical slot ``h`` belongs to
rank ``(h // P) % N`` at local row ``(h // (N * P)) * P + h % P``. The native
host pools (MLA KV and DSA indexer) hold local rows only, so every page is
read and written at its translated local row, and only on its owner.

Pages are keyed as on 0.5.18 (page hash + namespace digest, never CP rank or
size), so deployments of any CP size -- and the 0.5.18 adapter, for an
identical configuration -- share one store. Its I/O runs on the rank's L3
I/O threads (:mod:`sglang_cp_hicache.l3.rank`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping, Optional

import torch
from sglang.srt.mem_cache.utils import get_hash_str

from sglang_cp_hicache.l3.auth import UNKEYED, ObjectSeal
from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Counters, namespaces, open_tier_store
from sglang_cp_hicache.l3.store import PageStore
from sglang_cp_hicache.l3_backends import SGLangRules, open_page_store
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["L3Counters", "L3Tier", "local_row", "namespaces"]


class L3Tier(HostL3Tier):
    """One rank's L3 on 0.5.23's native host pools, at local rows. Built by
    :meth:`open` or :meth:`on_store` (classmethods only: the core class's
    methods are the tier's)."""

    @classmethod
    def open(
        cls, directory: Optional[str], source: str, placement: CpPlacement, kv_host: Any, indexer_host: Any, *,
        backend: str = "file", extra_config: Optional[Mapping[str, Any]] = None,
        mooncake_rules: Optional[SGLangRules] = None, **kwargs: Any,
    ) -> "L3Tier":
        """An L3 on ``backend``'s page store: a :class:`FilePageStore` at
        ``directory`` (created and proven writable now), or a Mooncake store
        configured from ``extra_config``. A bad one stops start-up, naming
        ``source``, the setting or flag that chose it."""
        store = open_tier_store(partial(open_page_store, mooncake_rules=mooncake_rules), backend, directory,
                                extra_config, source)
        return cls.on_store(store, placement, kv_host, indexer_host, **kwargs)

    @classmethod
    def on_store(
        cls, store: PageStore, placement: CpPlacement, kv_host: Any, indexer_host: Any, *,
        model_id: str, layer_start: int = 0, model_label: str = "", seal: ObjectSeal = UNKEYED,
    ) -> "L3Tier":
        """The tier on an opened ``store``: SGLang's page hash, and each
        logical host slot at this rank's local row; objects sealed with ``seal``."""
        tier = cls(store, placement, kv_host, indexer_host, model_id=model_id, page_hasher=get_hash_str,
                   layer_start=layer_start, host_row=partial(local_row, placement), model_label=model_label,
                   seal=seal)
        if tier.page_size != placement.page_size:
            raise ValueError(f"host page size {tier.page_size} != the placement's {placement.page_size}")
        return tier


def local_row(placement: CpPlacement, logical_slot: int) -> int:
    """This rank's local host row of an owned logical host slot."""
    return int(placement.logical_locs_to_physical(torch.tensor([logical_slot], dtype=torch.int64))[0])
