"""Opening one rank's L3 tier, the same for every SGLang release.

A release hands in one :class:`L3Binding`: SGLang's page hasher, its host
pools, how its tree's host slots map to host rows, the ranks a Mooncake
segment is shared by, and how to open a store. Everything else -- the
model identity of the server's arguments, the objects' seal, the store's
bad-configuration message, the tier itself -- is decided here once.

:func:`open_l3` runs before the CP ranks' start-up agreement and never
raises: an unusable store becomes this rank's agreement view, raised on
every rank once they all reached the agreement (:mod:`.rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_cp_hicache.l3.auth import seal_from_settings
from sglang_cp_hicache.l3.host_tier import HostL3Tier, HostRow, PageHasher, StoreOpener, open_tier_store
from sglang_cp_hicache.l3.identity import ModelIdentity, identity_of_server_args
from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.rank import L3Opening, open_tier
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.settings import L3_MODEL_ID, read

__all__ = ["L3Binding", "SERVED_BACKENDS", "check_served", "open_l3", "served", "server_identity",
           "storage_segment_ranks"]

#: The stores both adapters open (through ``l3_backends.open_page_store``).
SERVED_BACKENDS = ("file", "mooncake")


@dataclass(frozen=True)
class L3Binding:
    """What one SGLang release hands the L3 tier of one rank.

    ``page_hasher``: SGLang's ``get_hash_str``; ``kv_host`` /
    ``indexer_host``: the MLA KV and DSA indexer host pools; ``host_row``:
    the host row of a host slot the release's tree holds (None: the slot is
    the row); ``open_store(backend, directory, extra_config)``: the
    release's store opener (its Mooncake rules bound); ``layer_start``: the
    pools' first layer (pipeline parallelism)."""

    placement: CpPlacement
    page_hasher: PageHasher
    kv_host: Any
    indexer_host: Any
    open_store: StoreOpener
    layer_start: int = 0
    host_row: Optional[HostRow] = None


def served(location: L3Location) -> bool:
    """Whether the library serves the store ``location`` names."""
    return getattr(location, "backend", "file") in SERVED_BACKENDS


def check_served(location: L3Location, release: str) -> None:
    """Refuse, naming the flag, a store the library does not serve (rather
    than running without the L3 the user asked for)."""
    if not served(location):
        raise ValueError(
            f"--hicache-storage-backend {getattr(location, 'backend', None)!r} is not served by "
            f"sglang-cp-hicache's SGLang {release} adapter: use one of {', '.join(SERVED_BACKENDS)}"
        )


def storage_segment_ranks(server_args: Any, cp_size: int, *, times_pp: bool) -> int:
    """The ranks a Mooncake ``global_segment_size`` is shared by, as SGLang
    shares it: its storage config's TP size (attention TP under DP
    attention), times the PP size where the release counts it
    (``times_pp``: 0.5.23)."""
    tp, pp = getattr(server_args, "tp_size", None), getattr(server_args, "pp_size", 1)
    if not isinstance(tp, int) or tp < 1:
        return cp_size  # the cache used directly (the simulator, tests): its CP ranks
    dp = getattr(server_args, "dp_size", 1)
    if getattr(server_args, "enable_dp_attention", False) and isinstance(dp, int) and dp > 1:
        tp = max(1, tp // dp)
    return tp * (pp if times_pp and isinstance(pp, int) and pp >= 1 else 1)


def server_identity(server_args: Any) -> ModelIdentity:
    """The model identity of a server's arguments (the namespace's model)."""
    return identity_of_server_args(server_args, read(L3_MODEL_ID) or None)


def open_l3(
    location: L3Location, source: str, bind: Callable[[], L3Binding], *, identity: Optional[ModelIdentity] = None,
    server_args: Any = None,
) -> L3Opening:
    """This rank's L3 tier at ``location`` (see the module doc); ``source``
    names what chose the store, in the message of an unusable one;
    ``bind()``: the release's binding, built only when L3 is on (it reads
    SGLang's pools: a failure there is this rank's view too);
    ``identity``: the model's (None: from ``server_args``)."""

    def build() -> HostL3Tier:
        model = identity if identity is not None else server_identity(server_args)
        binding = bind()
        store = open_tier_store(binding.open_store, location.backend, location.directory, location.extra_config,
                                source)
        tier = HostL3Tier(
            store, binding.placement, binding.kv_host, binding.indexer_host, model_id=model.text(),
            page_hasher=binding.page_hasher, layer_start=binding.layer_start, host_row=binding.host_row,
            model_label=model.short(), seal=seal_from_settings(),
        )
        if tier.page_size != binding.placement.page_size:
            raise ValueError(f"host page size {tier.page_size} != the placement's {binding.placement.page_size}")
        return tier

    return open_tier(location, build)
