"""Switching CP HiCache on in an SGLang 0.5.18 server, without a fork.

SGLang 0.5.18 loads every installed ``sglang.srt.plugins`` entry point in each
scheduler process (``load_plugins()``), and picks a radix cache by name with
``--radix-cache-backend``. This package declares the entry point
``cp_hicache = sglang_cp_hicache.sglang_0518.plugin:register``, which registers the
backend ``cp-hicache``. Launch with::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --radix-cache-backend cp-hicache

The backend builds :class:`CpHiRadixCache` when the token allocator is this
library's :class:`CpSharedPagedTokenToKVPoolAllocator` (CP shared KV), and
otherwise defers to SGLang's own selection, so non-CP behaviour is untouched.
"""

from __future__ import annotations

import logging

from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.sglang_0518.checks import check_cp_hicache_server_args

logger = logging.getLogger(__name__)

BACKEND_NAME = "cp-hicache"

__all__ = ["BACKEND_NAME", "cp_hicache_factory", "register"]


def cp_hicache_factory(ctx):
    """``RadixCacheFactory`` for ``--radix-cache-backend cp-hicache``."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    allocator = ctx.params.token_to_kv_pool_allocator
    if not isinstance(allocator, CpSharedPagedTokenToKVPoolAllocator):
        logger.info("cp-hicache: allocator is not CP shared; using SGLang's default cache")
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
        "cp-hicache: CP shared KV HiCache on cp_rank %d of %d",
        allocator.cp_rank, allocator.cp_size,
    )
    return cache


def register() -> None:
    """Entry point: idempotent registration of the ``cp-hicache`` backend,
    under SGLang 0.5.18 only (other releases have their own adapter or none)."""
    import sglang

    from sglang_cp_hicache.sglang_0518 import check_sglang_version

    try:
        check_sglang_version(sglang.__version__)
    except RuntimeError as exc:
        logger.info("cp-hicache: the SGLang 0.5.18 adapter registers nothing: %s", exc)
        return
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sglang_cp_hicache.sglang_0518.hooks import HookMismatchError, check_hooks

    try:
        check_hooks()
    except HookMismatchError as exc:  # said now, in every scheduler; the cache refuses to build
        logger.warning("cp-hicache: %s; building the CP cache will fail", exc)
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, cp_hicache_factory)
