"""Run SGLang 0.5.23's KV-sharded DSA HiCache stack on a machine without CUDA.

The stack (``PageInterleaveDSATokenToKVPool``, ``PageInterleavePoolAllocator``,
``UnifiedRadixCache`` -> ``PageInterleaveHostPool`` + ``DSAIndexerPoolHost`` +
``HybridCacheController``) reaches CUDA in five places, none with a Python
fallback:

1. ``import sglang`` needs ``torchvision`` (a CUDA wheel on PyPI): the one
   stand-in in :mod:`.torchvision_standin`.
2. Host buffers are always allocated pinned (``alloc_with_host_register`` ->
   ``pool_host.common._cuda_host_register``): skipped without CUDA.
3. ``pool_host/mla.py`` and ``pool_host/dsa.py`` bind the
   ``sgl_kernel.kvcacheio.transfer_kv_*`` copy ops only under CUDA/HIP, so on
   CPU the first backup dies with ``NameError``. :data:`TRANSFER_OPS` are
   pure-torch versions of the four ops the sharded path calls (kernel io:
   ``layer_first`` / ``page_first``), with the kernels' byte semantics; the
   three ``direct``-io ops raise (KV sharding refuses ``direct`` io).
4. ``PageInterleaveKVPoolMixin`` builds a ``PyNcclCommunicator`` for its
   forward-path prefix gather, unconditionally: :class:`InertPyNcclCommunicator`.
5. ``torch.cpu.Stream`` has no ``synchronize``; ``l2_transfer``'s error path
   calls it, so any copy error surfaced as ``AttributeError``. A no-op is added
   while the support is installed, and the real error propagates.

This is upstream's own copy path on CPU (``owned_rows`` + the stock ops), the
baseline the library's kernels are compared with; nothing here routes a copy
through this library. The stock ops take raw addresses for the per-layer
tables; :func:`register_stack_buffers` maps those addresses back to the
tensors of one built stack (pure-torch indexing then bounds-checks every row),
and an address that was not registered raises instead of touching memory.

:func:`install_cpu_support` is idempotent; :func:`uninstall_cpu_support`
restores every original.
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from sglang_cp_hicache.testing.patching import PatchSet
from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

__all__ = [
    "SGLANG_VERSION",
    "TRANSFER_OPS",
    "CpuShardGroup",
    "InertPyNcclCommunicator",
    "cpu_support_installed",
    "ensure_sglang_importable",
    "install_cpu_support",
    "register_stack_buffers",
    "uninstall_cpu_support",
]

#: The release whose private module layout these shims follow.
SGLANG_VERSION = "0.5.23"

_PATCH_MARK = "__sglang_cp_hicache_cpu_0523_patch__"
_patches = PatchSet()


# ----------------------------------------------------------------------------
# Process-group stand-ins
# ----------------------------------------------------------------------------


@dataclass
class CpuShardGroup:
    """The fields of SGLang's ``GroupCoordinator`` the sharded pool reads."""

    world_size: int
    rank_in_group: int
    cpu_group: Any
    device_group: Any
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def rank(self) -> int:
        return self.rank_in_group

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))


class InertPyNcclCommunicator:
    """Stands in for ``PyNcclCommunicator`` on CPU.

    The sharded pool builds one for the forward pass's prefix gather; the
    HiCache path never uses it, so any use raises.
    """

    def __init__(self, group: Any = None, device: Any = None, **kwargs: Any) -> None:
        self.disabled = True
        self.world_size = group.size() if hasattr(group, "size") else 1

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"PyNcclCommunicator.{name} is not available on CPU: "
            "sglang_cp_hicache.testing.cpu_0523 installed an inert stand-in"
        )


# ----------------------------------------------------------------------------
# Address -> tensor registry for the stock ops' pointer tables
# ----------------------------------------------------------------------------

_buffers: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _register(pointers: torch.Tensor | None, tensors: Sequence[torch.Tensor]) -> None:
    if pointers is None:
        return
    addresses = [int(p) for p in pointers.tolist()]
    if len(addresses) != len(tensors):
        raise ValueError(f"pointer table has {len(addresses)} entries for {len(tensors)} tensors")
    for address, tensor in zip(addresses, tensors):
        if address != tensor.data_ptr():
            raise ValueError(f"pointer table entry {address:#x} is not the tensor's {tensor.data_ptr():#x}")
        _buffers[address] = tensor


def register_stack_buffers(host_pool_group: Any) -> int:
    """Register the pointer tables of every host pool in ``host_pool_group``
    (a ``HostPoolGroup``: the controller's ``mem_pool_host``) with the tensors
    they address. Returns the number of tables registered."""
    tables = 0
    for entry in host_pool_group.entries:
        pool = getattr(entry.host_pool, "host_pool", entry.host_pool)  # unwrap the sharded facade
        if hasattr(pool, "device_kv_buffers"):  # MLATokenToKVPoolHost
            _register(pool.device_data_ptrs, pool.device_kv_buffers)
            _register(pool.data_ptrs, pool.data_refs)
            tables += 2
        elif hasattr(pool, "packed_device_index_buffers"):  # DSAIndexerPoolHost
            _register(pool.index_k_device_ptrs, pool.packed_device_index_buffers)
            tables += 1
            if pool.layout == "layer_first":
                _register(pool.index_k_data_ptrs, pool.index_k_data_refs)
                tables += 1
        else:
            raise TypeError(f"no pointer tables known for host pool {type(pool).__name__}")
    return tables


def _resolve_table(name: str, pointers: torch.Tensor, num_layers: int) -> list[torch.Tensor]:
    addresses = [int(p) for p in pointers.tolist()]
    if len(addresses) < num_layers:
        raise ValueError(f"{name} has {len(addresses)} entries, fewer than num_layers={num_layers}")
    out = []
    for address in addresses[:num_layers]:
        tensor = _buffers.get(address)
        if tensor is None:
            raise RuntimeError(
                f"{name}: address {address:#x} belongs to no registered buffer; call "
                "cpu_0523.register_stack_buffers(controller.mem_pool_host) after building the stack"
            )
        out.append(tensor)
    return out


# ----------------------------------------------------------------------------
# Pure-torch sgl_kernel.kvcacheio ops (byte semantics of the CUDA kernels)
# ----------------------------------------------------------------------------


def _rows(tensor: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """A ``(rows, row_bytes)`` uint8 view of a contiguous buffer (assignable)."""
    if not tensor.is_contiguous():
        raise ValueError(f"transfer buffer must be contiguous, got strides {tensor.stride()}")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() % row_bytes:
        raise ValueError(f"buffer of {flat.numel()} bytes is not a whole number of {row_bytes}-byte rows")
    return flat.view(-1, row_bytes)


def _idx(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, **_kw) -> None:
    """One layer, row ``src_indices[i]`` of ``src`` -> row ``dst_indices[i]`` of ``dst``."""
    _rows(dst, item_size)[_idx(dst_indices)] = _rows(src, item_size)[_idx(src_indices)]


def transfer_kv_per_layer_mla_pf_lf(
    src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_kw
) -> None:
    """One layer from a page_first host buffer (row ``i`` of layer ``l`` at byte
    ``i * src_layout_dim + l * item_size``) to a layer_first device layer."""
    start = layer_id * item_size
    host = _rows(src, src_layout_dim)[:, start : start + item_size]
    _rows(dst, item_size)[_idx(dst_indices)] = host[_idx(src_indices)]


def transfer_kv_all_layer_mla(
    src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, **_kw
) -> None:
    """Every layer, through two tables of per-layer addresses."""
    sources = _resolve_table("src_layers", src_layers, num_layers)
    targets = _resolve_table("dst_layers", dst_layers, num_layers)
    s, d = _idx(src_indices), _idx(dst_indices)
    for src, dst in zip(sources, targets):
        _rows(dst, item_size)[d] = _rows(src, item_size)[s]


def transfer_kv_all_layer_mla_lf_pf(
    src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_kw
) -> None:
    """Every layer from per-layer device buffers (address table) into one
    page_first host buffer."""
    sources = _resolve_table("src_layers", src_layers, num_layers)
    host = _rows(dst, dst_layout_dim)
    s, d = _idx(src_indices), _idx(dst_indices)
    for layer_id, src in enumerate(sources):
        start = layer_id * item_size
        host[d, start : start + item_size] = _rows(src, item_size)[s]


def _direct_io_unsupported(name: str) -> Callable[..., None]:
    def op(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{name}: 'direct' io is not emulated on CPU (KV sharding requires kernel io)"
        )

    op.__name__ = name
    return op


#: Every name ``pool_host/mla.py`` and ``pool_host/dsa.py`` bind from
#: ``sgl_kernel.kvcacheio`` under CUDA.
TRANSFER_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_per_layer_mla": transfer_kv_per_layer_mla,
    "transfer_kv_per_layer_mla_pf_lf": transfer_kv_per_layer_mla_pf_lf,
    "transfer_kv_all_layer_mla": transfer_kv_all_layer_mla,
    "transfer_kv_all_layer_mla_lf_pf": transfer_kv_all_layer_mla_lf_pf,
    **{
        name: _direct_io_unsupported(name)
        for name in (
            "transfer_kv_direct",
            "transfer_kv_per_layer_direct_pf_lf",
            "transfer_kv_all_layer_direct_lf_pf",
        )
    },
}


# ----------------------------------------------------------------------------
# Install / uninstall
# ----------------------------------------------------------------------------


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _PATCH_MARK, True)
    return fn


def _skip_without_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    def register_or_skip(buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():
            return None  # nothing to pin without CUDA
        return original(buffer, *args, **kwargs)

    register_or_skip.__name__ = getattr(original, "__name__", "host_register")
    register_or_skip.__wrapped__ = original  # type: ignore[attr-defined]
    return _mark(register_or_skip)


def _no_op_synchronize(self: Any) -> None:
    return None  # CPU streams run synchronously


def _patch_plan() -> Iterable[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, make_replacement(original_or_missing)) per patch."""
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
    mla = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
    dsa = importlib.import_module("sglang.srt.mem_cache.pool_host.dsa")
    pool = importlib.import_module("sglang.srt.mem_cache.page_interleave_pool")

    plan: list[tuple[Any, str, Callable[[Any], Any]]] = [
        # alloc_with_host_register() looks these up in `common` at call time;
        # base and dsa bound _cuda_host_unregister at import.
        (common, "_cuda_host_register", _skip_without_cuda),
        (common, "_cuda_host_unregister", _skip_without_cuda),
        (base, "_cuda_host_unregister", _skip_without_cuda),
        (dsa, "_cuda_host_unregister", _skip_without_cuda),
        (pool, "PyNcclCommunicator", lambda original: InertPyNcclCommunicator),
    ]
    for module in (mla, dsa):
        for name, op in TRANSFER_OPS.items():
            plan.append((module, name, lambda original, op=op: _mark(op)))
    if not hasattr(torch.cpu.Stream, "synchronize"):
        plan.append((torch.cpu.Stream, "synchronize", lambda original: _mark(_no_op_synchronize)))
    return plan


def cpu_support_installed() -> bool:
    """True while the patches of :func:`install_cpu_support` are in place."""
    return _patches.installed


def install_cpu_support() -> bool:
    """Patch SGLang 0.5.23 so the sharded HiCache stack runs without CUDA.

    Acts only when CUDA is not usable (on a GPU the real ops run). Imports
    SGLang (through :func:`ensure_sglang_importable`) and checks that it is
    0.5.23. Idempotent. Returns True if the patches are in place.
    """
    with _patches.lock:
        if _patches.installed:
            return True
        if torch.cuda.is_available():
            return False
        ensure_sglang_importable()
        import sglang

        if sglang.__version__ != SGLANG_VERSION:
            raise RuntimeError(
                f"cpu_0523 shims follow sglang=={SGLANG_VERSION}, found {sglang.__version__}"
            )
        _patches.apply(_patch_plan())
        return True


def uninstall_cpu_support() -> None:
    """Restore every attribute :func:`install_cpu_support` replaced."""
    _patches.undo()
