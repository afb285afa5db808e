"""Plain-torch reference for the CP page copies; also the CPU backend.

Terms (shared with the Triton kernels):

* ``device_locs`` -- LOGICAL token locations of whole pages (length a multiple
  of ``page_size``; each page's locations contiguous and page aligned), int64.
* ``host_locs`` -- host slots for the tokens of ``device_locs`` that this rank
  owns, in order (length = owned tokens), int64, whole host pages.
* ``layout`` -- a :class:`~sglang_cp_hicache.placement.CpPlacement`; pages
  owned by other ranks are skipped, owned ones translated to physical slots.

Host buffers follow SGLang 0.5.18's ``MLATokenToKVPoolHost`` and
``DSAIndexerPoolHost`` shapes:

=================== ================================= ====================================
host layout         KV buffer                         indexer buffer
=================== ================================= ====================================
layer_first         (layers, slots, 1, dim)           (layers, host_pages, page_bytes)
page_first          (slots, layers, 1, dim)           (host_pages, layers, 1, page_bytes)
page_first_direct   (host_pages, layers, P, 1, dim)   (host_pages, layers, 1, page_bytes)
=================== ================================= ====================================

Device buffers: KV ``kv_buffer[layer]`` is ``(slots, 1, dim)`` (token major);
indexer ``index_k_with_scale_buffer[layer]`` is ``(pages, page_bytes)`` (page
major). The reference uses boolean indexing, so on CUDA it synchronises; the
Triton kernels do not. Since it reads the indices anyway, it always checks
their values (:func:`._checks.check_indices`: no negatives, whole aligned
pages, owned-token count, ranges) and raises ``ValueError`` naming the
argument, exactly like the Triton launchers do for CPU indices.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_cp_hicache.kernels import _checks
from sglang_cp_hicache.kernels._checks import HOST_LAYOUTS
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "HOST_LAYOUTS",
    "backup_indexer_all_layers_reference",
    "backup_kv_all_layers_reference",
    "load_indexer_one_layer_reference",
    "load_kv_one_layer_reference",
]


def _owned_physical(device_locs: torch.Tensor, layout: CpPlacement) -> torch.Tensor:
    """Physical device slots of the owned tokens, in order (aligned with
    ``host_locs`` once :func:`_checks.check_indices` passed)."""
    return layout.logical_locs_to_physical(device_locs[layout.owned_by_this_rank(device_locs)])


def _host_kv_rows(host_kv: torch.Tensor, host_layout: str, layer_id: int, page_size: int):
    """``(view, index_fn)``: ``view[index_fn(host_locs)]`` addresses one layer's host rows.

    Always a view into ``host_kv``, never a copy, so it can be assigned to.
    (``page_first_direct`` used to be flattened with ``reshape``, which copies
    when there is more than one layer: backups into it were silently lost.)
    """
    if host_layout == "layer_first":
        return host_kv[layer_id], lambda locs: locs
    if host_layout == "page_first":
        return host_kv[:, layer_id], lambda locs: locs
    if host_layout == "page_first_direct":
        # (pages, layers, P, 1, dim) -> (pages, P, 1, dim), indexed by (page, offset)
        return host_kv[:, layer_id], lambda locs: (
            torch.div(locs, page_size, rounding_mode="floor"),
            locs % page_size,
        )
    raise ValueError(f"host_layout must be one of {HOST_LAYOUTS}, got {host_layout!r}")


def _host_index_layer(host_index: torch.Tensor, host_layout: str, layer_id: int):
    """A (host_pages, page_bytes)-indexable accessor for one indexer layer."""
    if host_layout == "layer_first":
        return host_index[layer_id]
    if host_layout in ("page_first", "page_first_direct"):
        return host_index[:, layer_id, 0]
    raise ValueError(f"host_layout must be one of {HOST_LAYOUTS}, got {host_layout!r}")


def _pages(locs: torch.Tensor, page_size: int) -> torch.Tensor:
    return torch.div(locs.view(-1, page_size)[:, 0], page_size, rounding_mode="floor")


def _check_common(layout, host_layout, device_locs, host_locs) -> CpPlacement:
    layout = _checks.check_layout(layout)
    _checks.check_host_layout(host_layout)
    _checks.check_locs("device_locs", device_locs, layout.page_size)
    _checks.check_locs("host_locs", host_locs, layout.page_size)
    _checks.check_lengths(device_locs, host_locs)
    return layout


def _check_layers_fit(dev_name: str, num_dev_layers: int, host_name: str, geom) -> None:
    if num_dev_layers > geom.num_layers:
        raise ValueError(f"{dev_name} has {num_dev_layers} layers but {host_name} holds only {geom.num_layers}")


def backup_kv_all_layers_reference(
    device_kv: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
) -> None:
    """D2H: every layer's owned KV rows -> host slots."""
    layout = _check_common(layout, host_layout, device_locs, host_locs)
    layers = _checks.check_device_layers("device_kv", device_kv, ndim=3)
    geom = _checks.check_kv_call("device_kv[0]", layers[0], host_kv, host_layout, layout)
    _check_layers_fit("device_kv", len(layers), "host_kv", geom)
    _checks.check_indices(device_locs, host_locs, layout, layers[0].shape[0] // layout.page_size, geom.num_pages)
    phys = _owned_physical(device_locs, layout)
    if phys.numel() == 0:
        return
    for layer_id, dev in enumerate(layers):
        view, index = _host_kv_rows(host_kv, host_layout, layer_id, layout.page_size)
        view[index(host_locs.to(view.device))] = dev[phys].to(view.device)


def load_kv_one_layer_reference(
    device_kv_layer: torch.Tensor,
    host_kv: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
) -> None:
    """H2D: one layer's host slots -> owned physical KV rows."""
    layout = _check_common(layout, host_layout, device_locs, host_locs)
    _checks.check_device_layer("device_kv_layer", device_kv_layer, ndim=3)
    geom = _checks.check_kv_call("device_kv_layer", device_kv_layer, host_kv, host_layout, layout)
    _checks.check_layer_id("layer_id", layer_id, geom.num_layers)
    _checks.check_indices(
        device_locs, host_locs, layout, device_kv_layer.shape[0] // layout.page_size, geom.num_pages
    )
    phys = _owned_physical(device_locs, layout)
    if phys.numel() == 0:
        return
    view, index = _host_kv_rows(host_kv, host_layout, layer_id, layout.page_size)
    device_kv_layer[phys] = view[index(host_locs.to(view.device))].to(device_kv_layer.device)


def backup_indexer_all_layers_reference(
    device_index: Sequence[torch.Tensor],
    host_index: torch.Tensor,
    host_layout: str,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
) -> None:
    """D2H: every layer's owned indexer pages -> host pages (page granular)."""
    layout = _check_common(layout, host_layout, device_locs, host_locs)
    layers = _checks.check_device_layers("device_index", device_index, ndim=2)
    geom = _checks.check_index_call("device_index[0]", layers[0], host_index, host_layout)
    _check_layers_fit("device_index", len(layers), "host_index", geom)
    _checks.check_indices(device_locs, host_locs, layout, layers[0].shape[0], geom.num_pages)
    phys = _owned_physical(device_locs, layout)
    if phys.numel() == 0:
        return
    dev_pages = _pages(phys, layout.page_size)
    host_pages = _pages(host_locs, layout.page_size)
    for layer_id, dev in enumerate(layers):
        view = _host_index_layer(host_index, host_layout, layer_id)
        view[host_pages.to(view.device)] = dev[dev_pages].to(view.device)


def load_indexer_one_layer_reference(
    device_index_layer: torch.Tensor,
    host_index: torch.Tensor,
    host_layout: str,
    layer_id: int,
    device_locs: torch.Tensor,
    host_locs: torch.Tensor,
    layout: CpPlacement,
) -> None:
    """H2D: one layer's host indexer pages -> owned physical device pages."""
    layout = _check_common(layout, host_layout, device_locs, host_locs)
    _checks.check_device_layer("device_index_layer", device_index_layer, ndim=2)
    geom = _checks.check_index_call("device_index_layer", device_index_layer, host_index, host_layout)
    _checks.check_layer_id("layer_id", layer_id, geom.num_layers)
    _checks.check_indices(device_locs, host_locs, layout, device_index_layer.shape[0], geom.num_pages)
    phys = _owned_physical(device_locs, layout)
    if phys.numel() == 0:
        return
    dev_pages = _pages(phys, layout.page_size)
    host_pages = _pages(host_locs, layout.page_size)
    view = _host_index_layer(host_index, host_layout, layer_id)
    device_index_layer[dev_pages] = view[host_pages.to(view.device)].to(device_index_layer.device)
