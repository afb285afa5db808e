"""Copy one verified page into a host pool's rows, from several L3 I/O
threads at once, at memory speed -- or hand out the rows themselves, for a
read straight into them.

SGLang's ``set_from_flat_data_page`` assigns with a torch copy, which splits
every copy over torch's intra-op threads: with several L3 I/O threads
copying at once that oversubscribes the cores (measured on two cores: 3.7
GB/s from four I/O threads, against 5.0 with one single-threaded copy per
I/O thread). So the page goes through numpy (one thread per copy, the GIL
released) into the very tensor ``set_from_flat_data_page`` assigns to: the
view SGLang's ``get_data_page(index, flat=False)`` returns. A pool whose
unflattened page is not a view of its own buffer (not the same bytes, not on
the CPU) keeps SGLang's own copy.

:class:`HostPageRuns` gives the same view as the byte runs it covers, in
the page's flat order (one run per layer in SGLang's layer-first layouts,
one run in page-first): what a scatter read fills without a copy.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import numpy as np
import torch

from sglang_cp_hicache.l3.envelope import byte_view

__all__ = ["HostPageRuns", "write_host_page"]

#: At most this many runs a page (one scatter read takes the header and
#: these; Linux's IOV_MAX is 1024): a page in more pieces goes through a
#: staging buffer instead.
MAX_RUNS = 1023


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


class HostPageRuns:
    """One host pool's pages as byte runs of its own buffer.

    ``host``: the SGLang host pool; ``buffer``: its tensor (``kv_buffer``,
    ``index_k_with_scale_buffer``). The runs are memoryviews into the
    buffer's storage, valid while the pool lives.
    """

    def __init__(self, host: Any, buffer: torch.Tensor) -> None:
        self.host = host
        self.buffer = buffer
        self._storage: Optional[memoryview] = None
        if buffer.device.type == "cpu":
            storage = buffer.untyped_storage()
            self._base = storage.data_ptr()
            self._storage = byte_view(torch.empty(0, dtype=torch.uint8).set_(storage).view(torch.uint8))

    def runs(self, row: int, nbytes: int) -> list[memoryview] | None:
        """The runs of the ``nbytes``-byte page at host row ``row``, in the
        page's flat order; None where the pool does not hand out a view of
        its buffer (then only :func:`write_host_page` fills it)."""
        if self._storage is None:
            return None
        view = _page_view(self.host, row, self.buffer, nbytes)
        if view is None:
            return None
        shape, stride = list(view.shape), list(view.stride())
        lead, run = len(shape), 1
        while lead > 0 and (shape[lead - 1] == 1 or stride[lead - 1] == run):
            run *= shape[lead - 1]
            lead -= 1
        count = 1
        for n in shape[:lead]:
            count *= n
        if count > MAX_RUNS:
            return None
        start = view.data_ptr() - self._base
        if lead == 1:
            offsets = range(start, start + shape[0] * stride[0], stride[0]) if shape[0] else range(0)
        else:
            offsets = (start + sum(i * s for i, s in zip(index, stride))
                       for index in itertools.product(*(range(n) for n in shape[:lead])))
        return [self._storage[o:o + run] for o in offsets]
