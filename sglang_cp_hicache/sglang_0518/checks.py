"""Start-up checks for CP shared KV HiCache: refuse what it cannot honour, early."""

from __future__ import annotations

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.location import L3Location, l3_location

__all__ = ["HOST_BALANCE_ENV", "check_cp_hicache_server_args", "host_balance_policy", "storage_location"]

#: ``exact`` (default): when the rank holding the fewest host slots has no free
#: device page, evict for it so every rank's host share stays within one page
#: of 1/N. ``greedy``: never evict for that; the share may drift a few pages,
#: device hits are those of plain LRU.
HOST_BALANCE_ENV = settings.HOST_BALANCE.name


def host_balance_policy() -> str:
    """The host-balance policy from ``SGLANG_CP_HICACHE_HOST_BALANCE``; every
    rank must run the same one (it decides which device pages get evicted)."""
    return settings.read(settings.HOST_BALANCE)


def storage_location(server_args) -> L3Location:
    """Where this server's CP L3 lives (:func:`~sglang_cp_hicache.l3.location.l3_location`
    on ``--hicache-storage-backend`` and its extra config); a backend a CP
    cache cannot serve raises ValueError naming the flag."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    try:
        return l3_location(backend, getattr(server_args, "hicache_storage_backend_extra_config", None))
    except ValueError as exc:
        raise ValueError(f"CP shared KV (sglang-cp-hicache): hicache_storage_backend={backend!r} refused: {exc}") from None


def check_cp_hicache_server_args(server_args, *, cp_shared_kv: bool) -> None:
    """Refuse settings CP shared KV HiCache cannot honour, naming both sides.

    * ``hicache_storage_backend`` other than ``file``: SGLang's backends key
      objects by writer rank and would be handed rank-local host slots. With
      ``file`` the library serves the L3 tier itself (pages keyed by content,
      each owner writing and reading its own), in the directory
      :func:`storage_location` names.
    * ``hicache_write_policy='write_back'``: eviction would have to stage
      writes with a cross-rank decision inside device eviction.
    """
    if not cp_shared_kv:
        return
    storage_location(server_args)
    policy = getattr(server_args, "hicache_write_policy", "write_through")
    if policy == "write_back":
        raise ValueError(
            "CP shared KV (sglang-cp-hicache) does not support "
            "hicache_write_policy='write_back'; use write_through or write_through_selective."
        )
