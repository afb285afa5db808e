"""Shared builders for the L3 tests: namespaces, page hash chains, payloads;
a chain's own pages written and read one object at a time (what the tier
does for each page), and whole chains through a tier's writer and reads."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, Rejection
from sglang_cp_hicache.l3.keys import L3Namespace
from sglang_cp_hicache.l3.pages import PutOutcome, read_verified, store_verified
from sglang_cp_hicache.l3.plan import read_plan, write_plan

POISON = 0xA5


def namespace(**overrides) -> L3Namespace:
    """A small DSA-like KV namespace (tiny pages keep the tests fast)."""
    fields = dict(model_id="tiny/dsa", kv_dtype="float8_e4m3fn", row_bytes=656,
                  page_size=4, pool="kv", layer_start=0, layer_end=3)
    fields.update(overrides)
    return L3Namespace(**fields)


def hash_chain(num_pages: int, seed: int = 0, page_size: int = 4) -> list[str]:
    """A page hash chain shaped like SGLang's: d_i = SHA256(d_{i-1} || tokens LE u32)."""
    out: list[str] = []
    prev = b""
    for i in range(num_pages):
        tokens = [(seed * 1_000_003 + i * page_size + t) % 2**32 for t in range(page_size)]
        digest = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *tokens))
        out.append(digest.hexdigest())
        prev = digest.digest()
    return out


def payload(ns: L3Namespace, seed: int) -> torch.Tensor:
    """Random page bytes of ``ns``'s exact size."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (ns.page_bytes,), dtype=torch.uint8, generator=gen)


def write_chain(tier, hashes: list[str], owners: list[int], slots: list[int], parent=None) -> int:
    """Store a rank's own pages of a chain the way the server does (an
    :class:`L3Writer` on its own I/O threads) and wait for them; returns the
    pages this call wrote or kept whole."""
    from sglang_cp_hicache.l3.location import L3Timeouts
    from sglang_cp_hicache.l3.workers import L3Workers
    from sglang_cp_hicache.l3.writes import L3Writer

    before = tier.counters.written_pages + tier.counters.kept_pages
    workers = L3Workers("test-l3-write", threads=2)
    try:
        writer = L3Writer(tier, workers, L3Timeouts())
        writer.write(hashes, owners, slots, parent)
        assert writer.wait(30), "L3 writes still running after 30 s"
    finally:
        workers.shutdown()
    return tier.counters.written_pages + tier.counters.kept_pages - before


def read_chain(tier, hashes: list[str], owners: list[int], slots: list[int], parent=None) -> int:
    """Read a rank's own pages of a chain into its host pools page by page
    (``HostL3Tier.read_page``, as a prefetch does), stopping at the first one
    refused; returns the rank's local usable prefix (pages)."""
    kv_keys, idx_keys = tier.chain_keys(hashes, parent)
    mine = [i for i, owner in enumerate(owners) if owner == tier.placement.cp_rank]
    assert len(mine) == len(slots), (mine, slots)
    for index, slot in zip(mine, slots):
        if not tier.read_page(kv_keys[index], idx_keys[index], slot, lambda fn: fn()):
            return index
    return len(hashes)


def scratch(ns: L3Namespace) -> tuple[memoryview, memoryview]:
    """A reader's header and page buffers, poisoned."""
    return memoryview(bytearray([POISON]) * HEADER_BYTES), memoryview(bytearray([POISON]) * ns.page_bytes)


def write_own_pages(store, ns: L3Namespace, keys: list[str], pages: list[torch.Tensor], owners: list[int],
                    cp_size: int, rank: int, skip=()) -> list[PutOutcome]:
    """``rank`` stores its own pages of a chain (all but ``skip``), in chain order."""
    plan = write_plan(keys, owners, cp_size, rank)
    caps = StoreCapabilities.of(store)
    return [store_verified(caps, ns, keys[i], pages[i], scratch(ns)) for i in plan.page_indices if i not in skip]


@dataclass
class RankRead:
    """One rank's reads of its own pages of a chain (plan order)."""

    page_indices: tuple[int, ...]
    pages: list[Optional[torch.Tensor]]
    rejections: list[Optional[Rejection]]
    usable_pages: int


def read_own_pages(store, ns: L3Namespace, keys: list[str], owners: list[int], cp_size: int, rank: int) -> RankRead:
    """``rank`` reads and verifies each of its own pages of a chain; its
    local usable prefix is its first own page refused."""
    plan = read_plan(keys, owners, cp_size, rank)
    caps = StoreCapabilities.of(store)
    pages, rejections = [], []
    for key in plan.keys:
        head, page = scratch(ns)
        bad = read_verified(caps, ns, key, head, page)
        rejections.append(bad)
        pages.append(torch.frombuffer(bytearray(page), dtype=torch.uint8) if bad is None else None)
    usable = local_usable_pages(plan.page_indices, [bad is None for bad in rejections], plan.num_pages)
    return RankRead(plan.page_indices, pages, rejections, usable)


def check_reads(results: list[RankRead], agreed: int, want: list[torch.Tensor]) -> None:
    """Every page read is the page written, and every page below the
    group's agreed prefix was read sound on its owner."""
    for res in results:
        assert res.usable_pages >= agreed
        for index, page, bad in zip(res.page_indices, res.pages, res.rejections):
            if bad is None:
                assert torch.equal(page, want[index]), index
            else:
                assert page is None and index >= res.usable_pages, index
        assert all(bad is None for index, bad in zip(res.page_indices, res.rejections) if index < agreed)
