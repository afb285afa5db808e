"""Copy one verified page into a host pool's rows, from several L3 I/O
threads at once, at memory speed.

SGLang's ``set_from_flat_data_page`` assigns with a torch copy, which splits
every copy over torch's intra-op threads: with several L3 I/O threads
copying at once that oversubscribes the cores (measured on two cores: 3.7
GB/s from four I/O threads, against 5.0 with one single-threaded copy per
I/O thread). So the page goes through numpy (one thread per copy, the GIL
released) into the very tensor ``set_from_flat_data_page`` assigns to: the
view SGLang's ``get_data_page(index, flat=False)`` returns. A pool whose
unflattened page is not a view of its own buffer (not the same bytes, not on
the CPU) keeps SGLang's own copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["write_host_page"]


def _page_view(host: Any, row: int, buffer: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """The host page at ``row`` as a uint8 view into ``buffer``, or None where
    the pool does not hand out such a view."""
    view = host.get_data_page(row, flat=False)
    if not isinstance(view, torch.Tensor) or view.device.type != "cpu" or view.dtype != buffer.dtype:
        return None
    if view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        return None  # a copy, not the pool's bytes
    if view.numel() * view.element_size() != nbytes or view.stride(-1) != 1:
        return None
    return view.view(torch.uint8)


def write_host_page(host: Any, buffer: torch.Tensor, row: int, page: torch.Tensor) -> None:
    """Put ``page`` (a page's flat bytes in SGLang's flat order: a contiguous
    CPU uint8 tensor) into ``host`` at host row ``row``. ``buffer``: the
    pool's own tensor (``kv_buffer``, ``index_k_with_scale_buffer``)."""
    view = _page_view(host, row, buffer, page.numel())
    if view is None:
        host.set_from_flat_data_page(row, page.view(buffer.dtype))
        return
    np.copyto(view.numpy(), page.numpy().reshape(view.shape))
