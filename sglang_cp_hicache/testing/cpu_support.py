"""Run SGLang 0.5.18's HiCache host pools on a machine without CUDA.

SGLang's host pools reach CUDA in three places, none of which has a Python
fallback:

1. ``pin_memory=True`` (the default of every host pool) ends in
   ``cudaHostRegister`` (``pool_host.common._cuda_host_register``), and the L3
   helper ``get_dummy_flat_data_page`` asks torch for a pinned tensor.
2. ``MLATokenToKVPoolHost`` (``pool_host/mla.py``) and ``DSAIndexerPoolHost``
   (``memory_pool_host.py``) copy with ``sgl_kernel.kvcacheio.transfer_kv_*``,
   which is imported only when CUDA/HIP is present.
3. ``import sglang`` needs ``torchvision``, whose PyPI wheel is a CUDA build.

:func:`install_cpu_support` patches (1) and (2) on the two host pool classes
and on ``pool_host.common``; the transfers then go through this library's page
copy backend (:mod:`sglang_cp_hicache.kernels.transfer`) with the identity placement
``CpPlacement(page_size, 1, 0)`` -- without CP every device location is
its own physical slot. Nothing is faked in ``sgl_kernel`` and no environment
variable is set. :func:`uninstall_cpu_support` restores every original.
:func:`ensure_sglang_importable` handles (3) for one process, only when
``import torchvision`` fails.

Everything else a real ``HiRadixCache`` needs already works on CPU:
``torch.get_device_module()`` is ``torch.cpu``, whose ``Stream``/``Event`` are
synchronous no-ops (``Event.query()`` is always True), so every transfer has
finished when ``write``/``start_loading`` return and every ack is ready at the
next ``writing_check``/``loading_check``. ``torch.cpu.Event`` takes no
``enable_timing``; SGLang detects that and disables transfer timing with one
warning. See :mod:`sglang_cp_hicache.testing.env` for ServerArgs, publish and
process-group helpers.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from sglang_cp_hicache.kernels import transfer
from sglang_cp_hicache.kernels import HOST_LAYOUTS
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.testing.patching import PatchSet
from sglang_cp_hicache.testing.torchvision_standin import (  # noqa: F401  (re-exported)
    TORCHVISION_STANDIN_VERSION,
    ensure_sglang_importable,
    torchvision_standin_installed,
)

__all__ = [
    "IO_BACKENDS",
    "SGLANG_VERSION",
    "TORCHVISION_STANDIN_VERSION",
    "cpu_support_installed",
    "ensure_sglang_importable",
    "install_cpu_support",
    "torchvision_standin_installed",
    "uninstall_cpu_support",
]

from sglang_cp_hicache.sglang_0518 import SUPPORTED_SGLANG as SGLANG_VERSION  # noqa: E402
#: io backends the patched host pools accept (SGLang's own names).
IO_BACKENDS = ("kernel", "direct")

# Marks every function this module installs, so tests (and humans in a
# debugger) can tell a patched method from SGLang's own.
_PATCH_MARK = "__sglang_cp_hicache_cpu_patch__"

_patches = PatchSet()


# ----------------------------------------------------------------------------
# Host pool patches (gaps 1 and 2)
# ----------------------------------------------------------------------------


def _cuda_usable() -> bool:
    return torch.cuda.is_available()


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _PATCH_MARK, True)
    return fn


def _identity_placement(page_size: int) -> CpPlacement:
    # Non-CP: one rank owns every page and physical == logical.
    return CpPlacement(page_size, 1, 0)


def _as_locs(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(torch.int64).contiguous()


def _check_transfer(pool: Any, device_pool: Any, io_backend: str) -> None:
    if io_backend not in IO_BACKENDS:
        raise ValueError(
            f"Unsupported IO backend: {io_backend!r} (CPU support handles {IO_BACKENDS})"
        )
    if pool.layout not in HOST_LAYOUTS:
        raise ValueError(f"Unsupported layout: {pool.layout!r} (CPU support handles {HOST_LAYOUTS})")
    # Features the identity-layout backend does not model; fail loudly rather
    # than copy the wrong rows.
    if getattr(pool, "dcp_size", 1) != 1:
        raise NotImplementedError("CPU host-pool transfers do not support decode CP (dcp_size > 1)")
    if pool._is_device_layer_sharded(device_pool):
        raise NotImplementedError("CPU host-pool transfers do not support layer-sharded device pools")
    if pool.mtp_draft_device_pools:
        raise NotImplementedError("CPU host-pool transfers do not support packed MTP draft layers")


def _check_page_aligned(pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
    if host_indices.numel() != device_indices.numel():
        raise ValueError(
            f"host_indices ({host_indices.numel()}) and device_indices "
            f"({device_indices.numel()}) differ in length"
        )
    if host_indices.numel() % pool.page_size != 0:
        raise ValueError("Index buffer transfer expects page-aligned indices for DSA.")


def _mla_backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    """CPU ``MLATokenToKVPoolHost.backup_from_device_all_layer``: D2H, all layers."""
    _check_transfer(self, device_pool, io_backend)
    transfer.backup_kv_all_layers(
        device_pool.kv_buffer,
        self.kv_buffer,
        self.layout,
        _as_locs(device_indices),
        _as_locs(host_indices),
        _identity_placement(self.page_size),
    )


def _mla_load_to_device_per_layer(
    self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft: bool = False
):
    """CPU ``MLATokenToKVPoolHost.load_to_device_per_layer``: H2D, one layer."""
    if is_draft:
        raise NotImplementedError("CPU host-pool transfers do not support MTP draft layers")
    _check_transfer(self, device_pool, io_backend)
    transfer.load_kv_one_layer(
        device_pool.kv_buffer[layer_id],
        self.kv_buffer,
        self.layout,
        layer_id,
        _as_locs(device_indices),
        _as_locs(host_indices),
        _identity_placement(self.page_size),
    )


def _dsa_backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    """CPU ``DSAIndexerPoolHost.backup_from_device_all_layer``: D2H, page granular."""
    _check_transfer(self, device_pool, io_backend)
    _check_page_aligned(self, host_indices, device_indices)
    transfer.backup_indexer_all_layers(
        device_pool.index_k_with_scale_buffer,
        self.index_k_with_scale_buffer,
        self.layout,
        _as_locs(device_indices),
        _as_locs(host_indices),
        _identity_placement(self.page_size),
    )


def _dsa_load_to_device_per_layer(
    self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft: bool = False
):
    """CPU ``DSAIndexerPoolHost.load_to_device_per_layer``: H2D, one layer, page granular."""
    if is_draft:
        raise NotImplementedError("CPU host-pool transfers do not support MTP draft layers")
    _check_transfer(self, device_pool, io_backend)
    _check_page_aligned(self, host_indices, device_indices)
    transfer.load_indexer_one_layer(
        device_pool.index_k_with_scale_buffer[layer_id],
        self.index_k_with_scale_buffer,
        self.layout,
        layer_id,
        _as_locs(device_indices),
        _as_locs(host_indices),
        _identity_placement(self.page_size),
    )


def _wrap_dummy_flat_data_page(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def get_dummy_flat_data_page(self) -> torch.Tensor:
        if self.pin_memory and not _cuda_usable():
            # SGLang asks for a pinned zero page (L3 storage path), which
            # torch refuses without an accelerator. A host page has the same
            # element count and dtype as the one SGLang would build.
            return torch.zeros_like(self.get_data_page(0, flat=True), device="cpu")
        return original(self)

    get_dummy_flat_data_page.__wrapped__ = original  # type: ignore[attr-defined]
    return _mark(get_dummy_flat_data_page)


def _wrap_host_register(original: Callable[..., Any]) -> Callable[..., Any]:
    def register_or_skip(buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _cuda_usable():
            return None  # nothing to pin without CUDA
        return original(buffer, *args, **kwargs)

    register_or_skip.__name__ = original.__name__
    register_or_skip.__wrapped__ = original  # type: ignore[attr-defined]
    return _mark(register_or_skip)


def _patch_plan() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, make_replacement(original)) for every patch."""
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
    mla = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
    host = importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
    mla_cls, dsa_cls = mla.MLATokenToKVPoolHost, host.DSAIndexerPoolHost

    def replace_with(fn: Callable[..., Any]) -> Callable[[Any], Any]:
        return lambda original: _mark(fn)

    return [
        # alloc_with_host_register() looks _cuda_host_register up at call time.
        (common, "_cuda_host_register", _wrap_host_register),
        (common, "_cuda_host_unregister", _wrap_host_register),
        # HostKVCache.destroy() uses a name bound at import in pool_host/base.
        (base, "_cuda_host_unregister", _wrap_host_register),
        (mla_cls, "backup_from_device_all_layer", replace_with(_mla_backup_from_device_all_layer)),
        (mla_cls, "load_to_device_per_layer", replace_with(_mla_load_to_device_per_layer)),
        (mla_cls, "get_dummy_flat_data_page", _wrap_dummy_flat_data_page),
        (dsa_cls, "backup_from_device_all_layer", replace_with(_dsa_backup_from_device_all_layer)),
        (dsa_cls, "load_to_device_per_layer", replace_with(_dsa_load_to_device_per_layer)),
        (dsa_cls, "get_dummy_flat_data_page", _wrap_dummy_flat_data_page),
    ]


def cpu_support_installed() -> bool:
    """True while the patches of :func:`install_cpu_support` are in place."""
    return _patches.installed


def install_cpu_support(*, force: bool = False) -> bool:
    """Patch SGLang 0.5.18's host pools so HiCache runs without CUDA.

    Acts only when ``torch.cuda.is_available()`` is False, or when ``force``
    is True (then the transfers use this library's backend on any device,
    while ``cudaHostRegister`` still runs wherever CUDA is usable). Idempotent:
    a second call changes nothing. Returns True if the patches are in place.

    Patched (originals restored by :func:`uninstall_cpu_support`):

    * ``pool_host.common._cuda_host_register`` / ``_cuda_host_unregister`` and
      ``pool_host.base._cuda_host_unregister``: skipped without CUDA.
    * ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``:
      ``backup_from_device_all_layer`` and ``load_to_device_per_layer`` route
      through :mod:`sglang_cp_hicache.kernels.transfer` for every host layout in
      ``HOST_LAYOUTS`` and both io backends in ``IO_BACKENDS`` (the copy does
      not depend on the io backend); ``get_dummy_flat_data_page`` returns an
      unpinned page without CUDA.

    Decode CP (``dcp_size > 1``), layer-sharded device pools and MTP draft
    layers raise ``NotImplementedError`` in the patched transfers.

    Import errors propagate: call :func:`ensure_sglang_importable` first if
    ``torchvision`` cannot be imported.
    """
    with _patches.lock:
        if _patches.installed:
            return True
        if _cuda_usable() and not force:
            return False
        _patches.apply(_patch_plan())
        return True


def uninstall_cpu_support() -> None:
    """Restore every attribute :func:`install_cpu_support` replaced."""
    _patches.undo()
