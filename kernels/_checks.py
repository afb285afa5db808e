"""Argument checks and copy geometry shared by the Triton launchers and the
plain-torch reference.

Every check raises ``TypeError`` (wrong kind of object or dtype) or
``ValueError`` (wrong shape, length, range, device) with the offending
argument's name first in the message, so a caller can tell which input was
bad without reading a traceback. None of the checks here reads device memory
except :func:`check_indices` (index values: sign, page structure, owned-token
count, ranges, distinct destination pages), which the callers run only when
that is free -- indices on the CPU -- or when ``SGLANG_CP_HICACHE_DEBUG=1``
asks for it.

Both backends run the same checks, the memory ones included
(:func:`check_launchable`, :func:`check_call_indices`): a call the Triton
launchers refuse, the reference refuses with the same message, so a bad
caller fails the same way on a CPU test machine as on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_cp_hicache import settings
from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.validation import check_int

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

DEBUG_ENV = settings.DEBUG.name


def debug_enabled() -> bool:
    """``SGLANG_CP_HICACHE_DEBUG`` is read at every call, not at import."""
    return settings.enabled(settings.DEBUG)


@dataclass(frozen=True)
class HostGeometry:
    """Where one host page of one layer lives, in elements of the host dtype.

    Element ``(page, layer, row, col)`` of a copy is at
    ``page * page_stride + layer * layer_stride + row * row_stride + col``
    from the buffer's first element.
    """

    num_layers: int
    num_pages: int
    page_stride: int
    layer_stride: int
    row_stride: int
    rows_per_page: int
    row_elems: int


def check_placement(placement: object) -> CpPlacement:
    if not isinstance(placement, CpPlacement):
        raise TypeError(f"placement must be a CpPlacement, got {type(placement).__name__}")
    return placement


def check_host_layout(host_layout: object) -> str:
    if host_layout not in HOST_LAYOUTS:
        raise ValueError(f"host_layout must be one of {HOST_LAYOUTS}, got {host_layout!r}")
    return host_layout  # type: ignore[return-value]


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_locs(name: str, locs: object, page_size: int) -> torch.Tensor:
    """1-D int64 token locations covering whole pages."""
    locs = check_tensor(name, locs)
    if locs.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {locs.dtype}")
    if locs.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(locs.shape)}")
    if locs.numel() % page_size != 0:
        raise ValueError(
            f"{name} has {locs.numel()} entries, not a multiple of page_size={page_size}"
        )
    return locs


def check_layer_id(name: str, layer_id: object, num_layers: int) -> int:
    check_int(name, layer_id)
    if not 0 <= layer_id < num_layers:
        raise ValueError(f"{name} must be in [0, {num_layers}), got {layer_id}")
    return layer_id


def check_device_layers(name: str, layers: object, ndim: int) -> list[torch.Tensor]:
    """A non-empty sequence of per-layer device buffers of one shape/dtype/device."""
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError(f"{name} must be a sequence of per-layer tensors, got {type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError(f"{name} must hold at least one layer")
    first = check_tensor(f"{name}[0]", layers[0])
    for i, t in enumerate(layers):
        check_device_layer(f"{name}[{i}]", t, ndim)
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, but {name}[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    return layers


def check_device_layer(name: str, t: object, ndim: int) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if ndim == 3 and t.shape[1] != 1:
        raise ValueError(f"{name} must be (slots, 1, dim), got shape {tuple(t.shape)}")
    return t


def check_same_dtype(host_name: str, host: torch.Tensor, dev_name: str, dev: torch.Tensor) -> None:
    if host.dtype != dev.dtype:
        raise TypeError(f"{host_name} is {host.dtype} but {dev_name} is {dev.dtype}; they must match")


def host_kv_geometry(
    name: str, host_kv: torch.Tensor, host_layout: str, page_size: int, dim: int
) -> HostGeometry:
    """Geometry of an ``MLATokenToKVPoolHost.kv_buffer`` (SGLang 0.5.18 shapes)."""
    s = host_kv.stride()
    if host_layout == "layer_first":  # (layers, slots, 1, dim)
        _expect_shape(name, host_kv, host_layout, (None, None, 1, dim), "(layers, slots, 1, dim)")
        layers, slots = host_kv.shape[0], host_kv.shape[1]
        return HostGeometry(layers, slots // page_size, page_size * s[1], s[0], s[1], page_size, dim)
    if host_layout == "page_first":  # (slots, layers, 1, dim)
        _expect_shape(name, host_kv, host_layout, (None, None, 1, dim), "(slots, layers, 1, dim)")
        slots, layers = host_kv.shape[0], host_kv.shape[1]
        return HostGeometry(layers, slots // page_size, page_size * s[0], s[1], s[0], page_size, dim)
    # page_first_direct: (host_pages, layers, page_size, 1, dim)
    _expect_shape(
        name, host_kv, host_layout, (None, None, page_size, 1, dim),
        "(host_pages, layers, page_size, 1, dim)",
    )
    pages, layers = host_kv.shape[0], host_kv.shape[1]
    return HostGeometry(layers, pages, s[0], s[1], s[2], page_size, dim)


def host_index_geometry(
    name: str, host_index: torch.Tensor, host_layout: str, page_bytes: int
) -> HostGeometry:
    """Geometry of a ``DSAIndexerPoolHost.index_k_with_scale_buffer`` (0.5.18 shapes)."""
    s = host_index.stride()
    if host_layout == "layer_first":  # (layers, host_pages, page_bytes)
        _expect_shape(name, host_index, host_layout, (None, None, page_bytes), "(layers, host_pages, page_bytes)")
        layers, pages = host_index.shape[0], host_index.shape[1]
        return HostGeometry(layers, pages, s[1], s[0], page_bytes, 1, page_bytes)
    # page_first and page_first_direct: (host_pages, layers, 1, page_bytes)
    _expect_shape(
        name, host_index, host_layout, (None, None, 1, page_bytes), "(host_pages, layers, 1, page_bytes)"
    )
    pages, layers = host_index.shape[0], host_index.shape[1]
    return HostGeometry(layers, pages, s[0], s[1], page_bytes, 1, page_bytes)


def _expect_shape(name, t, host_layout, pattern, text) -> None:
    ok = t.dim() == len(pattern) and all(p is None or p == n for p, n in zip(pattern, t.shape))
    if not ok:
        raise ValueError(
            f"{name} must be {text} (last dim {pattern[-1]}) for host_layout={host_layout!r}, "
            f"got shape {tuple(t.shape)}"
        )


def check_kv_call(
    device_kv_layer_name: str,
    dev: torch.Tensor,
    host_kv: torch.Tensor,
    host_layout: str,
    placement: CpPlacement,
) -> HostGeometry:
    """Checks shared by both KV directions; returns the host geometry."""
    check_tensor("host_kv", host_kv)
    check_same_dtype("host_kv", host_kv, device_kv_layer_name, dev)
    return host_kv_geometry("host_kv", host_kv, host_layout, placement.page_size, dev.shape[-1])


def check_index_call(
    device_index_layer_name: str,
    dev: torch.Tensor,
    host_index: torch.Tensor,
    host_layout: str,
) -> HostGeometry:
    check_tensor("host_index", host_index)
    check_same_dtype("host_index", host_index, device_index_layer_name, dev)
    if dev.dtype != torch.uint8:
        raise TypeError(f"{device_index_layer_name} must be uint8 (fp8 keys + fp32 scales), got {dev.dtype}")
    return host_index_geometry("host_index", host_index, host_layout, dev.shape[-1])


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class PoolGeometry:
    """Device layers and the SGLang host buffer they copy to, validated together.

    ``device_layers`` are every layer of a backup (or the one layer of a
    direct load); ``dev_num_pages`` is pages per device layer, ``host`` the
    host buffer's geometry (its ``num_layers`` may exceed the device's).
    """

    kv: bool  # KV rows (token major) or indexer pages (page major)
    device_layers: tuple[torch.Tensor, ...]
    host_buffer: torch.Tensor
    host_layout: str
    host: HostGeometry
    dev_num_pages: int

    @property
    def device(self) -> torch.device:
        return self.device_layers[0].device


def _pool_geometry(
    kv: bool, dev_name: str, layers: list[torch.Tensor], host_buffer: object,
    host_layout: str, placement: CpPlacement,
) -> PoolGeometry:
    first = layers[0]
    if kv:
        geom = check_kv_call(dev_name, first, host_buffer, host_layout, placement)
        dev_num_pages = first.shape[0] // placement.page_size
    else:
        geom = check_index_call(dev_name, first, host_buffer, host_layout)
        dev_num_pages = first.shape[0]
    return PoolGeometry(kv, tuple(layers), host_buffer, host_layout, geom, dev_num_pages)


def check_backup_pool(
    kv: bool, dev_name: str, device_layers: object, host_name: str, host_buffer: object,
    host_layout: object, placement: CpPlacement,
) -> PoolGeometry:
    """Every device layer of a backup against the host buffer: host layout,
    one shape/dtype/device for all layers, dtype and row (or page) bytes equal
    to the host's, no more layers than the host holds."""
    host_layout = check_host_layout(host_layout)
    layers = check_device_layers(dev_name, device_layers, ndim=3 if kv else 2)
    pool = _pool_geometry(kv, f"{dev_name}[0]", layers, host_buffer, host_layout, placement)
    if len(layers) > pool.host.num_layers:
        raise ValueError(f"{dev_name} has {len(layers)} layers but {host_name} holds only {pool.host.num_layers}")
    return pool


def check_load_pool(
    kv: bool, dev_name: str, device_layer: object, host_buffer: object,
    host_layout: object, placement: CpPlacement,
) -> PoolGeometry:
    """The one device layer of a direct load against the host buffer."""
    host_layout = check_host_layout(host_layout)
    dev = check_device_layer(dev_name, device_layer, ndim=3 if kv else 2)
    return _pool_geometry(kv, dev_name, [dev], host_buffer, host_layout, placement)


def check_locs_pair(device_locs: object, host_locs: object, placement: CpPlacement) -> None:
    """The per-call checks of the index tensors that read no values."""
    check_locs("device_locs", device_locs, placement.page_size)
    check_locs("host_locs", host_locs, placement.page_size)
    check_lengths(device_locs, host_locs)


# ----------------------------------------------------------------------------- memory the kernel reads
def check_host_buffer(name: str, host: torch.Tensor, device: torch.device) -> None:
    """Dense host rows, in memory the device buffers' device can read."""
    if host.stride(-1) != 1:
        raise ValueError(f"{name} rows must be dense (stride(-1) == 1), got strides {host.stride()}")
    if device.type == "cuda":
        if host.device.type != "cpu" or not host.is_pinned():
            raise ValueError(
                f"{name} must be a pinned CPU tensor when the device buffers are on {device} "
                f"(got {'pinned ' if host.device.type == 'cpu' and host.is_pinned() else ''}"
                f"{host.device} memory); pageable memory cannot be read by the kernel"
            )
    elif host.device != device:
        raise ValueError(f"{name} is on {host.device} but the device buffers are on {device}")


def check_device_buffer(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def check_launchable(pool: PoolGeometry, dev_names: Sequence[str], host_name: str) -> None:
    """What the Triton kernel needs of a checked pool, and so what both
    backends demand: CUDA or CPU device layers, each contiguous; host rows
    dense; a pinned host buffer for CUDA layers, a CPU one for CPU layers."""
    device = pool.device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{dev_names[0]} is on {device}; the page copies take cuda (compiled Triton) "
            f"or cpu (Triton interpreter or the torch reference) tensors"
        )
    check_host_buffer(host_name, pool.host_buffer, device)
    for name, t in zip(dev_names, pool.device_layers):
        check_device_buffer(name, t)


def check_index_tensor(name: str, locs: torch.Tensor, device: torch.device) -> None:
    if locs.device != device:
        raise ValueError(f"{name} is on {locs.device} but the device buffers are on {device}")
    if not locs.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_call_indices(
    device_locs: object, host_locs: object, placement: CpPlacement, device: torch.device
) -> None:
    """Every per-call check of the index tensors that reads no values: dtype,
    shape, lengths, device (the device buffers'), contiguity."""
    check_locs_pair(device_locs, host_locs, placement)
    check_index_tensor("device_locs", device_locs, device)
    check_index_tensor("host_locs", host_locs, device)


def check_lengths(device_locs: torch.Tensor, host_locs: torch.Tensor) -> None:
    if host_locs.numel() > device_locs.numel():
        raise ValueError(
            f"host_locs has {host_locs.numel()} entries, more than the {device_locs.numel()} "
            f"in device_locs; it must list only the owned tokens"
        )


def check_owned_count(
    device_locs: torch.Tensor, host_locs: torch.Tensor, placement: CpPlacement
) -> torch.Tensor:
    """``len(host_locs)`` must equal the owned tokens of ``device_locs``.

    Reads ``device_locs`` (a sync when it lives on a GPU). Returns the mask.
    """
    owned = placement.owned_by_this_rank(device_locs)
    num_owned = int(owned.sum())
    if num_owned != host_locs.numel():
        raise ValueError(
            f"host_locs has {host_locs.numel()} entries but device_locs holds {num_owned} "
            f"tokens owned by cp_rank {placement.cp_rank}"
        )
    return owned


def check_indices(
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    placement: CpPlacement,
    dev_num_pages: int,
    host_num_pages: int,
    *,
    to_host: bool,
) -> None:
    """Full index validation; reads the indices (a device sync on CUDA).

    In this order: no negative location in either tensor; both list whole
    pages (each page's ``page_size`` locations contiguous, the first one page
    aligned); ``host_locs`` has exactly the owned tokens of ``device_locs``;
    every owned page's physical page fits the device buffer and every host
    page the host buffer; no destination page named twice (host pages of a
    backup, ``to_host``; owned device pages of a load). Both backends run it
    whenever the indices are on the CPU, so the same bad call fails the same
    way on either.
    """
    p = placement.page_size
    for name, locs in (("device_locs", device_locs), ("host_locs", host_locs)):
        if locs.numel() == 0:
            continue
        if bool((locs < 0).any()):
            raise ValueError(f"{name} holds negative locations (min {int(locs.min())})")
        pages = locs.view(-1, p)
        first = pages[:, :1]
        if bool((first % p != 0).any()) or not torch.equal(
            pages, first + torch.arange(p, device=locs.device)
        ):
            raise ValueError(
                f"{name} must list whole pages: each page's {p} locations contiguous and page aligned"
            )
    owned = check_owned_count(device_locs, host_locs, placement)
    if host_locs.numel() == 0:
        return
    phys_pages = placement.logical_locs_to_physical(device_locs[owned]) // p
    if int(phys_pages.max()) >= dev_num_pages:
        raise ValueError(
            f"device_locs maps to physical page {int(phys_pages.max())} on cp_rank "
            f"{placement.cp_rank}, beyond the device buffer's {dev_num_pages} pages"
        )
    host_pages = host_locs // p
    if int(host_pages.max()) >= host_num_pages:
        raise ValueError(
            f"host_locs reaches host page {int(host_pages.max())}, beyond the host "
            f"buffer's {host_num_pages} pages"
        )
    if to_host:
        _check_distinct_pages("host_locs", "host page", host_pages[::p], "a backup")
    else:
        logical_pages = device_locs[owned][::p] // p
        _check_distinct_pages("device_locs", "logical page", logical_pages, "a load")


def _check_distinct_pages(name: str, what: str, pages: torch.Tensor, copy: str) -> None:
    """Each destination page once: the kernel copies pages in parallel, so two
    copies into one page race and leave either one's bytes."""
    ordered = torch.sort(pages).values
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.numel():
        raise ValueError(
            f"{name} names {what} {int(repeated[0])} more than once; {copy} writes each "
            f"destination page once (two copies into one page race)"
        )
