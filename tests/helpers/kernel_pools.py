"""Helpers for the page-copy kernel tests (imported explicitly, not a conftest).

Builds SGLang-shaped device and host pools inside guard bands, fills sources
with random bytes and destinations with poison, and runs one copy through the
Triton launchers, the torch reference, or an independent page-by-page oracle
written straight from the layout formula. Comparisons are bitwise (uint8
views), so bf16 NaN patterns compare equal to themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from sglang_cp_hicache.kernels import _triton_launch as triton_copy
# HOST_LAYOUTS: the package's one list, handed on to the kernel tests.
from sglang_cp_hicache.kernels import HOST_LAYOUTS, reference, transfer  # noqa: F401
from sglang_cp_hicache.placement import CpPlacement

POISON = 0xA5
PAGE_SIZES = (1, 16, 64)

# name -> (kv?, dtype, row elements given page_size). Row bytes: indexer
# 132 * P (64 fp8 keys + 4-byte scale per token, page major), fp8 KV 656 B
# (stored as uint8), bf16 KV 576 elements = 1152 B.
BUFFERS: dict[str, tuple[bool, torch.dtype, Callable[[int], int]]] = {
    "indexer": (False, torch.uint8, lambda p: 132 * p),
    "kv_fp8": (True, torch.uint8, lambda p: 656),
    "kv_bf16": (True, torch.bfloat16, lambda p: 576),
    # not a real pool: 13-byte rows force byte-wide words (alignment fallback)
    "kv_odd": (True, torch.uint8, lambda p: 13),
}
MAIN_BUFFERS = ("indexer", "kv_fp8", "kv_bf16")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@dataclass
class Pools:
    """One rank's device layers and host buffer, each inside a guard band.

    ``dev_bigs``/``host_big`` are the whole allocations; the ``*_view``
    functions cut the interior the copy may touch.
    """

    kind: str
    placement: CpPlacement
    host_layout: str
    num_layers: int
    dev_bigs: list[torch.Tensor]
    host_big: torch.Tensor
    dev_view: Callable[[torch.Tensor], torch.Tensor]
    host_view: Callable[[torch.Tensor], torch.Tensor]

    @property
    def kv(self) -> bool:
        return BUFFERS[self.kind][0]

    @property
    def devs(self) -> list[torch.Tensor]:
        return [self.dev_view(b) for b in self.dev_bigs]

    @property
    def host(self) -> torch.Tensor:
        return self.host_view(self.host_big)

    def clone(self) -> "Pools":
        return dataclasses.replace(
            self, dev_bigs=[b.clone() for b in self.dev_bigs], host_big=self.host_big.clone()
        )

    def interior_masks(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Bool masks (byte granular) of the interiors inside each allocation."""
        dev = []
        for b in self.dev_bigs:
            m = torch.zeros(b.shape, dtype=torch.bool)
            self.dev_view(m).fill_(True)
            dev.append(m)
        h = torch.zeros(self.host_big.shape, dtype=torch.bool)
        self.host_view(h).fill_(True)
        return dev, h


def _random_bytes(shape, gen) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def _alloc(shape, dtype, fill, gen) -> torch.Tensor:
    """``shape`` in elements of ``dtype``; random bytes or POISON everywhere."""
    elem = torch.empty((), dtype=dtype).element_size()
    byte_shape = (*shape[:-1], shape[-1] * elem)
    raw = _random_bytes(byte_shape, gen) if fill == "random" else torch.full(byte_shape, POISON, dtype=torch.uint8)
    return raw.view(dtype)


def make_pools(
    kind: str,
    page_size: int,
    host_layout: str,
    placement: CpPlacement,
    *,
    num_layers: int = 3,
    dev_pages: int = 5,
    host_pages: int = 6,
    direction: str,
    dev_guard_rows: int | None = None,
    seed: int = 0,
) -> Pools:
    """Source filled with random bytes, destination with POISON (guards too).

    ``dev_guard_rows`` rows of guard before/after each device layer (default
    two pages' worth); an odd count shifts the interior off 16-byte alignment
    for rows that are not a multiple of 16 bytes. Host buffers get a guard
    page (or slot page) on each side and one extra layer.
    """
    kv, dtype, row_of = BUFFERS[kind]
    row = row_of(page_size)
    gen = torch.Generator().manual_seed(seed)
    dev_fill, host_fill = ("random", "poison") if direction == "d2h" else ("poison", "random")
    P, L = page_size, num_layers

    if kv:
        g = 2 * P if dev_guard_rows is None else dev_guard_rows
        slots = dev_pages * P
        dev_bigs = [_alloc((g + slots + g, 1, row), dtype, dev_fill, gen) for _ in range(L)]
        dev_view = lambda b, g=g, slots=slots: b[g : g + slots]
        hs = host_pages * P
        if host_layout == "layer_first":  # (layers, slots, 1, dim)
            host_big = _alloc((L + 2, hs + 2 * P, 1, row), dtype, host_fill, gen)
            host_view = lambda b: b[1 : L + 1, P : P + hs]
        elif host_layout == "page_first":  # (slots, layers, 1, dim)
            host_big = _alloc((hs + 2 * P, L + 1, 1, row), dtype, host_fill, gen)
            host_view = lambda b: b[P : P + hs, :L]
        else:  # (host_pages, layers, P, 1, dim)
            host_big = _alloc((host_pages + 2, L + 1, P, 1, row), dtype, host_fill, gen)
            host_view = lambda b: b[1 : host_pages + 1, 1:]
    else:
        g = 2 if dev_guard_rows is None else dev_guard_rows
        dev_bigs = [_alloc((g + dev_pages + g, row), dtype, dev_fill, gen) for _ in range(L)]
        dev_view = lambda b, g=g: b[g : g + dev_pages]
        if host_layout == "layer_first":  # (layers, host_pages, page_bytes)
            host_big = _alloc((L + 2, host_pages + 2, row), dtype, host_fill, gen)
            host_view = lambda b: b[1 : L + 1, 1 : host_pages + 1]
        else:  # (host_pages, layers, 1, page_bytes)
            host_big = _alloc((host_pages + 2, L + 1, 1, row), dtype, host_fill, gen)
            host_view = lambda b: b[1 : host_pages + 1, :L]
    return Pools(kind, placement, host_layout, L, dev_bigs, host_big, dev_view, host_view)


def page_locs(pages, page_size: int) -> torch.Tensor:
    """Token locations of whole pages, in the given page order."""
    pages = [int(p) for p in pages]
    if not pages:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


def owned_count(logical_pages, placement: CpPlacement) -> int:
    return sum(1 for p in logical_pages if p % placement.cp_size == placement.cp_rank)


def small_buffers(kind: str, page_size: int) -> dict:
    """Valid keyword buffers of a backup (or bind) for the argument checks: 2
    layers of 4 device pages and 3 host pages; ``kind`` "kv" (bf16 rows,
    layer_first) or "indexer" (uint8 pages, page_first)."""
    p = page_size
    if kind == "kv":
        return dict(device_kv=[torch.zeros(4 * p, 1, 8, dtype=torch.bfloat16) for _ in range(2)],
                    host_kv=torch.zeros(2, 3 * p, 1, 8, dtype=torch.bfloat16), host_layout="layer_first")
    return dict(device_index=[torch.zeros(4, 132 * p, dtype=torch.uint8) for _ in range(2)],
                host_index=torch.zeros(3, 2, 1, 132 * p, dtype=torch.uint8), host_layout="page_first")


# ----------------------------------------------------------------------------- runners
#: Each backend's four copies, by name: backup KV, load KV, backup indexer, load indexer.
_TRITON_NAMES = ("backup_kv_all_layers", "load_kv_one_layer", "backup_indexer_all_layers", "load_indexer_one_layer")
_REFERENCE_NAMES = tuple(f"{name}_reference" for name in _TRITON_NAMES)


def _run_copy(module, names: tuple[str, ...], pools: Pools, direction: str, device_locs, host_locs,
              layer_id: int, **kw) -> None:
    """The copy of ``pools``' kind and ``direction`` from ``module`` (looked up
    at call time, so a test's spy on the module is seen)."""
    backup_kv, load_kv, backup_idx, load_idx = (getattr(module, name) for name in names)
    placement, hl = pools.placement, pools.host_layout
    if direction == "d2h":
        (backup_kv if pools.kv else backup_idx)(pools.devs, pools.host, hl, device_locs, host_locs, placement, **kw)
    else:
        (load_kv if pools.kv else load_idx)(
            pools.devs[layer_id], pools.host, hl, layer_id, device_locs, host_locs, placement, **kw
        )


def run_triton(pools: Pools, direction: str, device_locs, host_locs, layer_id: int = 0, **kw) -> None:
    _run_copy(triton_copy, _TRITON_NAMES, pools, direction, device_locs, host_locs, layer_id, **kw)


def run_reference(pools: Pools, direction: str, device_locs, host_locs, layer_id: int = 0) -> None:
    _run_copy(reference, _REFERENCE_NAMES, pools, direction, device_locs, host_locs, layer_id)


def run_transfer(pools: Pools, direction: str, device_locs, host_locs, layer_id: int = 0) -> None:
    """Through the public door, :mod:`sglang_cp_hicache.kernels.transfer`."""
    _run_copy(transfer, _TRITON_NAMES, pools, direction, device_locs, host_locs, layer_id)


def _host_page(pools: Pools, host, layer: int, host_page: int) -> torch.Tensor:
    P = pools.placement.page_size
    if pools.kv:
        if pools.host_layout == "layer_first":
            return host[layer, host_page * P : (host_page + 1) * P]
        if pools.host_layout == "page_first":
            return host[host_page * P : (host_page + 1) * P, layer]
        return host[host_page, layer]
    if pools.host_layout == "layer_first":
        return host[layer, host_page]
    return host[host_page, layer, 0]


def run_oracle(pools: Pools, direction: str, device_locs, host_locs, layer_id: int = 0) -> None:
    """Page by page, straight from page(loc)=loc//P, owner=page%N, phys=page//N."""
    P, N, r = pools.placement.page_size, pools.placement.cp_size, pools.placement.cp_rank
    devs, host = pools.devs, pools.host
    k = 0
    for j in range(device_locs.numel() // P):
        logical_page = int(device_locs[j * P]) // P
        if logical_page % N != r:
            continue
        phys_page = logical_page // N
        host_page = int(host_locs[k * P]) // P
        k += 1
        layers = range(pools.num_layers) if direction == "d2h" else [layer_id]
        for layer in layers:
            dev_page = devs[layer][phys_page * P : (phys_page + 1) * P] if pools.kv else devs[layer][phys_page]
            hp = _host_page(pools, host, layer, host_page)
            if direction == "d2h":
                hp.copy_(dev_page)
            else:
                dev_page.copy_(hp)
    assert k * P == host_locs.numel()


# ----------------------------------------------------------------------------- assertions
def assert_same_bytes(a: Pools, b: Pools, what: str = "") -> None:
    for i, (x, y) in enumerate(zip(a.dev_bigs, b.dev_bigs)):
        assert torch.equal(bits(x), bits(y)), f"{what}: device layer {i} differs"
    assert torch.equal(bits(a.host_big), bits(b.host_big)), f"{what}: host buffer differs"


def check_copy(
    pools: Pools, direction: str, device_locs, host_locs, layer_id: int = 0, **kw
) -> Pools:
    """Run the Triton launcher and check it against the reference and the oracle.

    Asserts: bitwise equality of every allocation (interiors and guards) with
    both; the source side unchanged; every guard byte still POISON on the
    destination side. Returns the Triton result.
    """
    before = pools.clone()
    got, ref, orc = pools.clone(), pools.clone(), pools.clone()
    run_triton(got, direction, device_locs, host_locs, layer_id, **kw)
    run_reference(ref, direction, device_locs, host_locs, layer_id)
    run_oracle(orc, direction, device_locs, host_locs, layer_id)
    assert_same_bytes(ref, orc, "reference vs page oracle")
    assert_same_bytes(got, ref, "triton vs reference")
    dev_masks, host_mask = got.interior_masks()
    if direction == "d2h":
        for i, (x, y) in enumerate(zip(got.dev_bigs, before.dev_bigs)):
            assert torch.equal(bits(x), bits(y)), f"source device layer {i} changed"
        guard = bits(got.host_big)[~_byte_mask(host_mask, got.host_big)]
        assert bool((guard == POISON).all()), "host guard band written"
    else:
        assert torch.equal(bits(got.host_big), bits(before.host_big)), "source host buffer changed"
        for i, (x, m) in enumerate(zip(got.dev_bigs, dev_masks)):
            guard = bits(x)[~_byte_mask(m, x)]
            assert bool((guard == POISON).all()), f"device layer {i} guard band written"
        for i, (x, y) in enumerate(zip(got.dev_bigs, before.dev_bigs)):
            if i != layer_id:
                assert torch.equal(bits(x), bits(y)), f"device layer {i} written by a load of layer {layer_id}"
    return got


def _byte_mask(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Element mask -> byte mask matching ``bits(t)``."""
    elem = t.element_size()
    return mask.repeat_interleave(elem, dim=-1) if elem > 1 else mask


def changed_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bits(a) != bits(b)).sum())
