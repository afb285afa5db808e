"""Start-up checks for CP shared KV HiCache: refuse what it cannot honour, early."""

from __future__ import annotations

from sglang_cp_hicache import settings

__all__ = ["HOST_BALANCE_ENV", "check_cp_hicache_server_args", "host_balance_policy"]

#: ``exact`` (default): when the rank holding the fewest host slots has no free
#: device page, evict for it so every rank's host share stays within one page
#: of 1/N. ``greedy``: never evict for that; the share may drift a few pages,
#: device hits are those of plain LRU.
HOST_BALANCE_ENV = settings.HOST_BALANCE.name


def host_balance_policy() -> str:
    """The host-balance policy from ``SGLANG_CP_HICACHE_HOST_BALANCE``; every
    rank must run the same one (it decides which device pages get evicted)."""
    return settings.read(settings.HOST_BALANCE)


def check_cp_hicache_server_args(server_args, *, cp_shared_kv: bool) -> None:
    """Refuse settings CP shared KV HiCache cannot honour, naming both sides.

    * ``hicache_storage_backend`` (SGLang's own L3): host pages are per-rank
      shards with rank-local slot numbers, and SGLang's backends key objects
      by writer rank; the library's own L3 (``SGLANG_CP_HICACHE_L3_DIR``)
      keys pages by content and has each owner write and read its own.
    * ``hicache_write_policy='write_back'``: eviction would have to stage
      writes with a cross-rank decision inside device eviction.
    """
    if not cp_shared_kv:
        return
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend is not None:
        raise ValueError(
            "CP shared KV (sglang-cp-hicache) does not support "
            f"hicache_storage_backend={backend!r}: host-only CP HiCache. "
            "Unset --hicache-storage-backend or disable CP shared KV; for an L3 "
            f"tier under CP set {settings.L3_DIR.name} to a shared directory."
        )
    policy = getattr(server_args, "hicache_write_policy", "write_through")
    if policy == "write_back":
        raise ValueError(
            "CP shared KV (sglang-cp-hicache) does not support "
            "hicache_write_policy='write_back'; use write_through or write_through_selective."
        )
