"""Switching the library's copy kernels on in an SGLang 0.5.23 server.

SGLang loads every installed ``sglang.srt.plugins`` entry point in the
launcher and in each scheduler process (``load_plugins()``). This package
declares ``cp_hicache_0523 = sglang_cp_hicache.sglang_0523.plugin:register``,
which registers :class:`~.strategy.LibraryDsaStrategy`. It changes only
stacks built on upstream's KV-sharded DSA pool (``--enable-kv-cache-sharding``
with HiCache on a DSA model); every other stack keeps upstream's strategies.

With the library copy path it also lifts upstream's refusal of
``--hicache-storage-backend file`` under KV sharding: the library serves that
tier itself (:mod:`.storage_lift`, :mod:`.l3_cache`).

``SGLANG_CP_HICACHE_COPY`` picks the copy path: ``library`` (default) or
``upstream``: :class:`~.strategy.UpstreamDsaStrategy`, which builds upstream's
own stack and only takes part in the CP ranks' start-up agreement, so that
ranks started on different copy paths are refused on every rank instead of
hanging (on another release, or one that changed a hooked name, ``upstream``
registers nothing). Each rank logs one line naming the copy path its stack
was built with. ``SGLANG_PLUGINS`` (SGLang's allow-list of plugin names) can
leave this plugin out entirely: then nothing of it runs (no such line) and
that rank joins no agreement.

On SGLang 0.5.18 (no KV sharding) it registers nothing and says that the
plugin ``cp_hicache`` serves that release (a WARNING when ``SGLANG_PLUGINS``
leaves that one out).

SGLang only logs a plugin that raises, so nothing here refuses by raising:
a supported release registers the strategy, whose ``build`` runs the start-up
check and raises inside cache construction (which does stop the server). A
release without KV sharding (0.5.18, which has the strategy seam but no
sharded pool) is left alone; any other release that has the seam and the
pool, a release that lacks or changed a name in :data:`~.hooks.HOOKS`, or an
unknown ``SGLANG_CP_HICACHE_COPY`` value, gets
a strategy that refuses to build the sharded DSA stack with the reason --
never a silent fallback to upstream's copies.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any, Callable

from sglang_cp_hicache import releases, settings
from sglang_cp_hicache.sglang_0523 import SUPPORTED_SGLANG, check_sglang_version

__all__ = ["COPY_ENV", "COPY_PATHS", "PLUGIN_NAME", "copy_path_from_env", "register"]

logger = logging.getLogger(__name__)

#: Environment variable that selects the copy path.
COPY_ENV = settings.COPY.name
COPY_PATHS = settings.COPY.choices
#: This adapter's entry point name (``pyproject.toml``).
PLUGIN_NAME = "cp_hicache_0523"

_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
# The KV-sharded pool. SGLang 0.5.18 has the assembler (and its strategy seam)
# but not this: there a strategy of ours must not be registered at all, since
# every HiCache stack build would ask it to match.
_SHARDED_POOL = "sglang.srt.mem_cache.page_interleave_pool"


def copy_path_from_env() -> str:
    """``library`` or ``upstream``; ValueError naming the valid values."""
    return settings.read(settings.COPY)


def _refusing_strategy(refuse: Callable[[], None]) -> Any:
    """A strategy that matches the sharded DSA stack and raises ``refuse()``'s
    error when SGLang builds it (cache construction stops the server)."""
    assembler = importlib.import_module(_ASSEMBLER)

    class UnsupportedReleaseStrategy(assembler._DsaStrategy):
        def matches(self, kvcache: Any, components: set) -> bool:
            pool = importlib.import_module(_SHARDED_POOL)
            return isinstance(kvcache, pool.PageInterleaveKVPoolMixin) and super().matches(
                kvcache, components
            )

        def build(self, **kwargs: Any) -> Any:
            refuse()
            raise AssertionError("unreachable: refuse() raises")

    return UnsupportedReleaseStrategy()


def register() -> None:
    """Entry point (``sglang.srt.plugins``); idempotent."""
    import sglang

    version = sglang.__version__
    if importlib.util.find_spec(_ASSEMBLER) is None or importlib.util.find_spec(_SHARDED_POOL) is None:
        # No KV sharding in this release (0.5.18): nothing to register.
        is_warning, text = releases.not_my_release(PLUGIN_NAME, version)
        logger.log(logging.WARNING if is_warning else logging.INFO, "%s (sglang %s has no KV sharding)", text, version)
        return
    try:
        path = copy_path_from_env()
    except ValueError as exc:
        logger.error("sglang-cp-hicache: %s; KV-sharded DSA HiCache will refuse to start", exc)
        importlib.import_module(_ASSEMBLER).register_stack_strategy(_refusing_strategy(copy_path_from_env))
        return
    if path == "upstream" and version != SUPPORTED_SGLANG:
        # Its build copies 0.5.23's upstream build: on any other release it
        # could differ from upstream's own, so it stays out.
        logger.info("sglang-cp-hicache: %s=upstream on sglang %s: nothing registered", COPY_ENV, version)
        return
    try:
        check_sglang_version(version)
    except RuntimeError:
        logger.error(
            "sglang-cp-hicache supports sglang==%s, found %s: KV-sharded DSA HiCache will refuse to start",
            SUPPORTED_SGLANG, version,
        )
        importlib.import_module(_ASSEMBLER).register_stack_strategy(
            _refusing_strategy(lambda: check_sglang_version(version))
        )
        return
    from sglang_cp_hicache.sglang_0523.hooks import HookMismatchError, check_hooks

    try:
        # Before importing the strategy module: it imports SGLang names at import.
        check_hooks()
    except HookMismatchError as exc:
        if path == "upstream":
            logger.warning("sglang-cp-hicache: %s=upstream: nothing registered (%s)", COPY_ENV, exc)
            return
        logger.error("%s KV-sharded DSA HiCache will refuse to start.", exc)
        importlib.import_module(_ASSEMBLER).register_stack_strategy(_refusing_strategy(check_hooks))
        return
    from sglang_cp_hicache.sglang_0523.strategy import install_strategy

    install_strategy(path)
    if path == "library":
        # --hicache-storage-backend file under KV sharding: the library's L3.
        from sglang_cp_hicache.sglang_0523.storage_lift import register_storage_lift

        register_storage_lift()
    if path == "upstream":
        logger.info("sglang-cp-hicache: %s=upstream, SGLang keeps its own sharded stack "
                    "(this plugin only joins the CP ranks' start-up agreement)", COPY_ENV)
        return
    logger.info("sglang-cp-hicache: library copy kernels registered for KV-sharded DSA HiCache")
