"""L3 page stores on third-party storage systems, behind the core
:class:`~sglang_cp_hicache.l3.store.PageStore` interface.

The core L3 (``sglang_cp_hicache.l3``) stays torch and stdlib only; a store
here may import its system's client, and does so only when it is opened.
:func:`open_page_store` turns ``--hicache-storage-backend`` (as resolved by
``l3.location.l3_location``) into a store; :func:`store_opener` binds it to
one rank of an SGLang release (what an adapter's L3 binding hands the wing).
Modules: ``mooncake`` (:class:`MooncakePageStore`, its config) and
``mooncake_forms`` (how each SGLang release reads Mooncake's settings).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.capacity import CapacityConfig
from sglang_cp_hicache.l3.location import parse_extra_config
from sglang_cp_hicache.l3.store import FilePageStore, PageStore
from sglang_cp_hicache.l3_backends.mooncake import MooncakeConfig, MooncakePageStore
from sglang_cp_hicache.l3_backends.mooncake_forms import SGLangRules, sglang_mooncake_config

__all__ = [
    "MooncakeConfig", "MooncakePageStore", "SGLangRules", "file_capacity", "open_page_store",
    "sglang_mooncake_config", "store_opener",
]


def file_capacity(extra_config: Union[None, str, Mapping[str, Any]]) -> CapacityConfig:
    """The bound of a file L3 directory, as SGLang's file backend reads it:
    ``max_size`` / ``min_free_space`` / ``eviction_ratio`` of the extra
    config, else its ``SGLANG_HICACHE_FILE_BACKEND_*`` variables."""
    extra = parse_extra_config(extra_config)
    environ = {s.name: settings.read(s) for s in (settings.FILE_MAX_SIZE, settings.FILE_MIN_FREE,
                                                   settings.FILE_EVICTION_RATIO)}
    return CapacityConfig.from_sources(extra, environ, settings.read(settings.L3_EVICTION))


def open_page_store(
    backend: str,
    directory: Union[None, str, os.PathLike],
    extra_config: Union[None, str, Mapping[str, Any]] = None,
    *,
    mooncake_rules: Optional[SGLangRules] = None,
) -> PageStore:
    """This rank's store for ``backend``: ``"file"`` -> a
    :class:`FilePageStore` in ``directory``; ``"mooncake"`` -> a
    :class:`MooncakePageStore` configured as SGLang configures its Mooncake
    backend (the extra config, ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` or the
    ``MOONCAKE_*`` environment; ``mooncake_rules``: the SGLang release and
    this rank's place, see :mod:`.mooncake_forms`; ``directory`` unused).
    Raises ValueError naming the argument for a bad one, before any I/O of
    another backend."""
    if backend == "file":
        if directory is None:
            raise ValueError("directory is required for the file backend, got None")
        return FilePageStore(directory, capacity=file_capacity(extra_config))
    if backend == "mooncake":
        return MooncakePageStore(sglang_mooncake_config(extra_config, mooncake_rules))
    raise ValueError(f"backend must be 'file' or 'mooncake', got {backend!r}")


def store_opener(release: str, segment_ranks: int, rank: int) -> Callable[..., PageStore]:
    """:func:`open_page_store` for one rank of SGLang ``release``: (backend,
    directory, extra_config) -> its store, Mooncake read by that release's
    rules (:class:`SGLangRules`, checked when a store opens)."""

    def open_store(backend: str, directory: Union[None, str, os.PathLike],
                   extra_config: Union[None, str, Mapping[str, Any]] = None) -> PageStore:
        rules = SGLangRules(release, segment_ranks=segment_ranks, rank=rank)
        return open_page_store(backend, directory, extra_config, mooncake_rules=rules)

    return open_store
