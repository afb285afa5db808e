"""The L3 host copy (:func:`write_host_page`) against SGLang's own
``set_from_flat_data_page``, on the release's real host pool classes.

The pools are instances of SGLang's ``MLATokenToKVPoolHost`` and
``DSAIndexerPoolHost`` whose buffers are built here in the shapes their
``init_kv_buffer`` allocates (no device pool is needed for the page
accessors): the page methods that run are the release's own.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from sglang_cp_hicache.l3.host_copy import write_host_page

LAYERS, P, KV_DIM, IDX_STRIDE, PAGES = 3, 64, 40, 64 * 6, 5
POISON = 0xA5
#: (host layout, (KV buffer shape, indexer buffer shape)) as SGLang allocates them.
LAYOUTS = {
    "layer_first": ((LAYERS, PAGES * P, 1, KV_DIM), (LAYERS, PAGES, IDX_STRIDE)),
    "page_first": ((PAGES * P, LAYERS, 1, KV_DIM), (PAGES, LAYERS, 1, IDX_STRIDE)),
    "page_first_direct": ((PAGES, LAYERS, P, 1, KV_DIM), (PAGES, LAYERS, 1, IDX_STRIDE)),
}


def host_pools(kv_cls: type, indexer_cls: type, layout: str) -> tuple[Any, Any]:
    """A KV and an indexer host pool of ``layout``, every byte POISON."""
    kv_shape, idx_shape = LAYOUTS[layout]
    kv = object.__new__(kv_cls)
    kv.kv_buffer = torch.full(kv_shape, POISON, dtype=torch.uint8).view(torch.float8_e4m3fn)
    kv.layout, kv.page_size, kv.layer_num, kv.kv_cache_dim, kv.dcp_size = layout, P, LAYERS, KV_DIM, 1
    kv.dtype, kv.size, kv.page_num = kv.kv_buffer.dtype, PAGES * P, PAGES
    idx = object.__new__(indexer_cls)
    idx.index_k_with_scale_buffer = torch.full(idx_shape, POISON, dtype=torch.uint8)
    idx.layout, idx.page_size, idx.layer_num, idx.indexer_page_stride_size = layout, P, LAYERS, IDX_STRIDE
    return kv, idx


def _buffer(pool: Any) -> torch.Tensor:
    return pool.kv_buffer if hasattr(pool, "kv_buffer") else pool.index_k_with_scale_buffer


def check_same_bytes_as_sglang(kv_cls: type, indexer_cls: type, layout: str) -> None:
    """Page 1 written through the library, page 3 through SGLang's copy, from
    one flat page: both read back as that page, every other byte of the pool
    is still POISON, and the library never fell back to SGLang's copy."""
    for pool in host_pools(kv_cls, indexer_cls, layout):
        buffer = _buffer(pool)
        nbytes = buffer.numel() * buffer.element_size() // PAGES
        flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        pool.set_from_flat_data_page(3 * P, flat.view(buffer.dtype))
        sglang_copy = pool.set_from_flat_data_page

        def refuse(*args: Any) -> None:
            raise AssertionError("write_host_page fell back to set_from_flat_data_page")

        pool.set_from_flat_data_page = refuse
        write_host_page(pool, buffer, 1 * P, flat)
        pool.set_from_flat_data_page = sglang_copy
        for row in (1 * P, 3 * P):
            assert torch.equal(pool.get_data_page(row).view(torch.uint8), flat), (layout, type(pool).__name__, row)
        for row in (0, 2 * P, 4 * P):
            page = pool.get_data_page(row).view(torch.uint8)
            assert torch.equal(page, torch.full_like(page, POISON)), (layout, type(pool).__name__, row)


def check_a_copied_page_falls_back(kv_cls: type, indexer_cls: type) -> None:
    """A pool whose unflattened page is a copy (not its own bytes) is written
    through its own set_from_flat_data_page."""
    kv, _ = host_pools(kv_cls, indexer_cls, "layer_first")
    original = kv.get_data_page
    kv.get_data_page = lambda index, flat=True: original(index, flat).clone()
    flat = torch.arange(kv.kv_buffer.numel() // PAGES, dtype=torch.int64).remainder(251).to(torch.uint8)
    write_host_page(kv, kv.kv_buffer, 2 * P, flat)
    assert torch.equal(original(2 * P).view(torch.uint8), flat)


def host_copy_tests(kv_cls: type, indexer_cls: type) -> tuple[Callable[[str], None], Callable[[], None]]:
    """The two host-copy tests of a release whose SGLang host pool classes
    are ``kv_cls`` and ``indexer_cls`` (a release's test module binds them
    to test names)."""

    @pytest.mark.parametrize("layout", sorted(LAYOUTS))
    def test_the_host_copy_writes_what_sglangs_copy_writes(layout: str) -> None:
        check_same_bytes_as_sglang(kv_cls, indexer_cls, layout)

    def test_a_pool_that_hands_out_a_copy_gets_sglangs_copy() -> None:
        check_a_copied_page_falls_back(kv_cls, indexer_cls)

    return test_the_host_copy_writes_what_sglangs_copy_writes, test_a_pool_that_hands_out_a_copy_gets_sglangs_copy
