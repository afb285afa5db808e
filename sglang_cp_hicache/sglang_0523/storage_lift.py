"""Let ``--hicache-storage-backend file`` or ``mooncake`` through SGLang
0.5.23's KV-sharding check when, and only when, this library serves the
storage tier.

Upstream's ``handle_kv_cache_sharding`` refuses any storage backend under
``--enable-kv-cache-sharding`` (its storage path would write rank-local rows
under logical slots, keyed by rank). With the library stack the storage tier
is the library's L3 (:mod:`.l3_cache`): each owner writes and reads its own
pages under topology-free keys, and SGLang's storage controller stays off.

The lift goes through SGLang's sanctioned hook for that resolution step
(``register_resolution_hook("handle_kv_cache_sharding")``): for the one call
of the step, a declaration that reads ``hicache_storage_backend`` as unset is
put on top of the record's resolution stash and taken off again afterwards
(a declaration, not a field write: fields cannot be assigned mid-resolution;
everything else the step checks and declares runs as usual). It applies only
while the library strategy is this process's (plugin registered,
``SGLANG_CP_HICACHE_COPY=library``) and for a backend this adapter serves
(:data:`~sglang_cp_hicache.l3.opening.SERVED_BACKENDS`, as resolved
by :func:`~sglang_cp_hicache.l3.location.l3_location`: ``mooncake`` needs its
``master_server_address``); every other case -- upstream's copy path,
another backend, a Mooncake store without a master -- runs upstream's step
untouched, refusal included.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.srt.arg_groups.model_override_base import ResolvedView, ResolvingConfig, record_of, resolving_view
from sglang.srt.arg_groups.overrides import declare_resolution
from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

from sglang_cp_hicache.l3.location import l3_location
from sglang_cp_hicache.l3.opening import served
from sglang_cp_hicache.sglang_0523.strategy import installed_copy_path

__all__ = ["STEP", "library_serves_storage", "lift_storage_refusal", "register_storage_lift"]

STEP = "handle_kv_cache_sharding"
#: The declaration's source, as SGLang's resolution stash records it.
SOURCE = "sglang-cp-hicache: storage served by the library's L3 (this step only)"

_registered = False


def library_serves_storage(cfg: Any) -> bool:
    """Whether this library will serve the storage tier of the resolving config."""
    if not (cfg.enable_kv_cache_sharding and cfg.enable_hierarchical_cache):
        return False
    if cfg.hicache_storage_backend is None or installed_copy_path() != "library":
        return False
    try:
        location = l3_location(cfg.hicache_storage_backend, cfg.hicache_storage_backend_extra_config)
    except ValueError:
        return False
    return served(location)


def lift_storage_refusal(server_args: Any, previous: Callable[[Any], None]) -> None:
    """The wrapper of the step (see the module doc)."""
    cfg = resolving_view(server_args)
    if not library_serves_storage(cfg):
        return previous(server_args)
    record = record_of(server_args) if isinstance(server_args, (ResolvingConfig, ResolvedView)) else server_args
    backend = cfg.hicache_storage_backend
    declare_resolution(record, SOURCE, hicache_storage_backend=None)
    try:
        return previous(server_args)
    finally:
        declare_resolution(record, SOURCE, hicache_storage_backend=backend)


def register_storage_lift() -> None:
    """Register the wrapper once per process (idempotent)."""
    global _registered
    if not _registered:
        register_resolution_hook(STEP)(lift_storage_refusal)
        _registered = True
