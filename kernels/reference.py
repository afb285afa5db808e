"""Plain-torch reference for the CP page copies; also the CPU backend.

Terms (shared with the Triton kernels):

* ``device_locs`` -- LOGICAL token locations of whole pages (length a multiple
  of ``page_size``; each page's locations contiguous and page aligned), int64.
* ``host_locs`` -- host slots for the tokens of ``device_locs`` that this rank
  owns, in order (length = owned tokens), int64, whole host pages.
* ``placement`` -- a :class:`~sglang_cp_hicache.placement.CpPlacement`; pages
  owned by other ranks are skipped, owned ones translated to physical slots.
* ``host_layout`` -- SGLang's host memory layout string (table below).

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
pages, owned-token count, ranges, no destination page twice) and raises
``ValueError`` naming the argument, exactly like the Triton launchers do for
CPU indices.

It refuses everything the Triton launchers refuse, with their messages,
although torch indexing could copy it: non-contiguous device layers or index
tensors, host rows that are not dense, indices on another device, unpinned
host memory for CUDA layers (:func:`._checks.check_launchable`,
:func:`._checks.check_call_indices`). A caller tested on the CPU backend then
cannot hand the GPU a call it refuses.

Each public function checks the buffers (:class:`~._copies.CopyFunctions`,
shared with the other backends) and hands the result to :func:`run`, which
checks only the index tensors: :class:`~.bound.PoolCopies` calls it directly
with the pool it checked once, at bind time.
"""

from __future__ import annotations

import torch

from . import _checks
from ._checks import PoolGeometry
from ._copies import CheckedCopy, CopyFunctions
from sglang_cp_hicache.placement import CpPlacement

__all__ = [
    "backup_indexer_all_layers_reference",
    "backup_kv_all_layers_reference",
    "load_indexer_one_layer_reference",
    "load_kv_one_layer_reference",
    "run",
]


def _owned_physical(device_locs: torch.Tensor, placement: CpPlacement) -> torch.Tensor:
    """Physical device slots of the owned tokens, in order (aligned with
    ``host_locs`` once :func:`_checks.check_indices` passed)."""
    return placement.logical_locs_to_physical(device_locs[placement.owned_by_this_rank(device_locs)])


def _host_view(pool: PoolGeometry, layer_id: int) -> torch.Tensor:
    """One layer of the host buffer, indexable by :func:`_index_pair`'s host
    index. Always a view, never a copy (``reshape`` would copy a multi-layer
    ``page_first_direct`` buffer), so it can be assigned to."""
    host, host_layout = pool.host_buffer, pool.host_layout
    if host_layout == "layer_first":
        return host[layer_id]
    if pool.kv:
        return host[:, layer_id]  # (slots, 1, dim), or (pages, P, 1, dim) for page_first_direct
    return host[:, layer_id, 0]  # (host_pages, page_bytes)


def _pages(locs: torch.Tensor, page_size: int) -> torch.Tensor:
    return torch.div(locs.view(-1, page_size)[:, 0], page_size, rounding_mode="floor")


def _index_pair(pool: PoolGeometry, phys: torch.Tensor, host_locs: torch.Tensor, page_size: int):
    """``(device index, host index)`` of the owned rows (KV) or pages (indexer)."""
    host_locs = host_locs.to(pool.host_buffer.device)
    if not pool.kv:
        return _pages(phys, page_size), _pages(host_locs, page_size)
    if pool.host_layout == "page_first_direct":  # indexed by (page, offset)
        return phys, (torch.div(host_locs, page_size, rounding_mode="floor"), host_locs % page_size)
    return phys, host_locs


def run(copy: CheckedCopy) -> None:
    """One copy of a checked pool (a backup's every layer, or a load's one
    device layer); checks only the index tensors, their values included (this
    backend reads them anyway)."""
    pool, placement, device_locs, host_locs = copy.pool, copy.placement, copy.device_locs, copy.host_locs
    _checks.check_call_indices(device_locs, host_locs, placement, pool.device)
    _checks.check_indices(
        device_locs, host_locs, placement, pool.dev_num_pages, pool.host.num_pages, to_host=copy.to_host
    )
    phys = _owned_physical(device_locs, placement)
    if not phys.numel():
        return
    dev_at, host_at = _index_pair(pool, phys, host_locs, placement.page_size)
    if copy.to_host:
        for layer_id, dev in enumerate(pool.device_layers):
            view = _host_view(pool, layer_id)
            view[host_at] = dev[dev_at].to(view.device)
    else:
        dev = pool.device_layers[0]
        dev[dev_at] = _host_view(pool, copy.layer_id)[host_at].to(dev.device)


# The four copies (signatures and buffer checks in :class:`~._copies.CopyFunctions`).
_COPIES = CopyFunctions(run)
backup_kv_all_layers_reference = _COPIES.backup_kv_all_layers
load_kv_one_layer_reference = _COPIES.load_kv_one_layer
backup_indexer_all_layers_reference = _COPIES.backup_indexer_all_layers
load_indexer_one_layer_reference = _COPIES.load_indexer_one_layer
