"""Switching CP HiCache on in an SGLang 0.5.18 server.

SGLang 0.5.18 loads every installed ``sglang.srt.plugins`` entry point in each
scheduler process (``load_plugins()``), and picks a radix cache by name with
``--radix-cache-backend``. This package declares the entry point
``cp_hicache = sglang_cp_hicache.sglang_0518.plugin:register``, which registers the
backend ``cp-hicache``. Launch with::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --radix-cache-backend cp-hicache

The backend builds :class:`CpHiRadixCache` only when the token allocator is
this library's :class:`CpSharedPagedTokenToKVPoolAllocator` (CP shared KV).
Stock SGLang 0.5.18 never builds a CP shared KV pool: the server must install
that allocator where its model runner builds the KV pool. Without it, every
rank logs a WARNING naming the allocator it found and serves SGLang's default
cache (no CP HiCache); each rank logs one line saying which copy path runs.

On another release this plugin registers nothing and says what serves that
release (SGLang 0.5.23: the plugin ``cp_hicache_0523``), never advice that
holds only on 0.5.18.
"""

from __future__ import annotations

import importlib.util
import logging

from sglang_cp_hicache import releases, settings
from sglang_cp_hicache.sglang_0518 import SUPPORTED_SGLANG

logger = logging.getLogger(__name__)

BACKEND_NAME = "cp-hicache"
#: This adapter's entry point name (``pyproject.toml``).
PLUGIN_NAME = "cp_hicache"
#: What the backend needs and stock SGLang 0.5.18 lacks.
CP_ALLOCATOR = "sglang_cp_hicache.sglang_0518.allocator.CpSharedPagedTokenToKVPoolAllocator"

__all__ = ["BACKEND_NAME", "CP_ALLOCATOR", "PLUGIN_NAME", "cp_hicache_factory", "register"]


def cp_hicache_factory(ctx):
    """``RadixCacheFactory`` for ``--radix-cache-backend cp-hicache``."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
    from sglang_cp_hicache.sglang_0518.checks import check_cp_hicache_server_args

    allocator = ctx.params.token_to_kv_pool_allocator
    if not isinstance(allocator, CpSharedPagedTokenToKVPoolAllocator):
        logger.warning(
            "sglang-cp-hicache: --radix-cache-backend %s needs a CP shared KV pool: the token allocator must be "
            "%s, this server's is %s.%s. Stock SGLang 0.5.18 never builds one; install it where the "
            "model runner builds the KV pool. Copy path: SGLang's default cache, no CP HiCache on this rank.",
            BACKEND_NAME, CP_ALLOCATOR, type(allocator).__module__, type(allocator).__qualname__,
        )
        return default_radix_cache_factory(ctx)
    check_cp_hicache_server_args(ctx.server_args, cp_shared_kv=True)
    if not ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend cp-hicache with a CP shared KV allocator needs "
            "--enable-hierarchical-cache"
        )
    from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache

    cache = CpHiRadixCache(ctx.params, ctx.server_args)
    ctx.tp_worker.register_hicache_layer_transfer_counter(cache.cache_controller.layer_done_counter)
    logger.info(
        "sglang-cp-hicache: CP shared KV HiCache on cp_rank %d of %d. Copy path: library (this library's "
        "kernels, backend %s)",
        allocator.cp_rank, allocator.cp_size, cache.cp_warmup.backend,
    )
    return cache


def _other_release(version: str) -> tuple[bool, str]:
    """What this plugin says on SGLang ``version`` (not 0.5.18): the
    adapter that serves it, or why this one cannot (and, only where
    HiRadixCache still exists, how to try it anyway)."""
    is_warning, text = releases.not_my_release(PLUGIN_NAME, version)
    if releases.adapter_for(version) is not None:
        return is_warning, text
    if importlib.util.find_spec("sglang.srt.mem_cache.hiradix_cache") is None:
        return True, f"{text}: SGLang {version} has no HiRadixCache (0.5.21 removed it)"
    return True, (
        f"{text}; set {settings.ALLOW_ANY_SGLANG.name}=1 to try it on SGLang {version} anyway "
        "(the start-up hook check still runs)"
    )


def register() -> None:
    """Entry point: idempotent registration of the ``cp-hicache`` backend,
    under SGLang 0.5.18 only (other releases have their own adapter or none)."""
    import sglang

    version = sglang.__version__
    if version != SUPPORTED_SGLANG and not settings.enabled(settings.ALLOW_ANY_SGLANG):
        is_warning, text = _other_release(version)
        logger.log(logging.WARNING if is_warning else logging.INFO, "%s", text)
        return
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sglang_cp_hicache.sglang_0518.hooks import HookMismatchError, check_hooks

    try:
        check_hooks()
    except HookMismatchError as exc:  # said now, in every scheduler; the cache refuses to build
        logger.warning("sglang-cp-hicache: %s; building the CP cache will fail", exc)
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, cp_hicache_factory)
