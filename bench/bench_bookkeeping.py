"""CPU bookkeeping costs of the path the CP cache runs: split, the write plan,
the load plan (with the allocator checkpoint the adapter opens per load-back
to undo a refused one), host eviction.

Usage: python bench/bench_bookkeeping.py [--out FILE.csv]

Without ``--out`` it writes a new file under ``build/bench-results/``;
``--out bench/results/bookkeeping.csv`` replaces the committed figures.

Host eviction is timed for L = 1e2 .. 1e5 evictable leaves, evicting k = 100
of them per call: with the incremental index the cost per evicted leaf stays
flat in L (O(k log L)), where rebuilding a heap of every leaf would grow
linearly in L.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import os
import platform
import statistics
import sys
import time
from typing import Optional

import torch

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.allocator import OwnerLaneAllocator
from sglang_cp_hicache.policy_0518.host_eviction import HostLeafIndex, evict_host_slots
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import set_host_state
from sglang_cp_hicache.policy_0518.plan import plan_load, plan_write
from sglang_cp_hicache.testing.tree_nodes import Node

from bench_paths import new_out_path


def _time_us(fn, repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(0.8 * (len(samples) - 1))]


class _HostPool:
    def __init__(self, size: int) -> None:
        self.next = 0
        self.size = size

    def alloc(self, n: int) -> torch.Tensor:
        if self.next + n > self.size:
            self.next = 0
        out = torch.arange(self.next, self.next + n)
        self.next += n
        return out


def _node(page_size: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(CPU page mirror, logical locs) of a node of ``tokens`` tokens from page 1."""
    pages = torch.arange(1, 1 + tokens // page_size)
    return pages, torch.arange(page_size, page_size + tokens)


def bench_split(rows: list, page_size: int, cp_size: int, tokens: int) -> None:
    placement = CpPlacement(page_size, cp_size, 0)
    meta = plan_write(placement, *_node(page_size, tokens), _HostPool(10**7).alloc).metadata
    cut = (tokens // 2 // page_size) * page_size
    p50, p80 = _time_us(lambda: meta.split(cut), 2000)
    rows.append(("split", page_size, cp_size, tokens, "", p50, p80))


def bench_write(rows: list, page_size: int, cp_size: int, tokens: int) -> None:
    placement = CpPlacement(page_size, cp_size, 0)
    pool = _HostPool(10**7)
    pages, locs = _node(page_size, tokens)
    # trusted: the cache hands in its own validated page mirror (as the adapter does)
    p50, p80 = _time_us(lambda: plan_write(placement, pages, locs, pool.alloc, trusted=True), 1000)
    rows.append(("write_plan", page_size, cp_size, tokens, "", p50, p80))


def bench_load(rows: list, page_size: int, cp_size: int, tokens: int) -> None:
    placement = CpPlacement(page_size, cp_size, 0)
    meta = plan_write(placement, *_node(page_size, tokens), _HostPool(10**7).alloc).metadata
    alloc = OwnerLaneAllocator(page_size * (4 * tokens // page_size + 4 * cp_size), page_size, cp_size)

    def once():
        cp = alloc.checkpoint()  # what the adapter opens to undo a refused load exactly
        plan = plan_load(placement, [meta], alloc)
        alloc.commit(cp)
        alloc.free_mirrored(plan.allocation.pages)

    p50, p80 = _time_us(once, 500)
    rows.append(("load_plan", page_size, cp_size, tokens, "", p50, p80))


def bench_load_vs_free_pages(rows: list, free_pages: int, chain_pages: int = 16) -> None:
    """One load-back's bookkeeping with a large free pool, undone the old way
    (a snapshot of every free list, O(free pages)) and the current way (an
    undo log, O(pages touched)); both then roll the allocation back."""
    page_size, cp_size = 64, 8
    placement = CpPlacement(page_size, cp_size, 0)
    meta = plan_write(placement, *_node(page_size, chain_pages * page_size), _HostPool(10**7).alloc).metadata
    alloc = OwnerLaneAllocator(page_size * free_pages, page_size, cp_size)

    def with_snapshot():
        snap = alloc.snapshot()
        plan_load(placement, [meta], alloc)
        alloc.restore(snap)

    def with_undo_log():
        cp = alloc.checkpoint()
        plan_load(placement, [meta], alloc)
        alloc.rollback(cp)

    for name, fn in (("load_back_refused_snapshot", with_snapshot), ("load_back_refused_undo_log", with_undo_log)):
        p50, p80 = _time_us(fn, 50)
        rows.append((name, page_size, cp_size, chain_pages * page_size, f"free={free_pages}", p50, p80))


def bench_alloc(rows: list, num_pages: int = 16, cp_size: int = 8) -> None:
    """A new request's pages (the allocator's part of ``alloc_extend``): plain,
    steered by the host ledger (``lane_bias``), and steered with the least
    loaded lane empty so every page needs ``lane_reclaim`` (here a stand-in
    that frees a held page of that lane; the cache's own LRU scan is
    SGLang's eviction heap, O(evictable leaves), as ``evict()``)."""
    page_size = 64
    total = num_pages * cp_size * 4

    def make(bias=None, reclaim=False):
        alloc = OwnerLaneAllocator(page_size * total, page_size, cp_size)
        held: list[int] = []
        if bias is not None:
            alloc.lane_bias = lambda: bias
        if reclaim:
            held = alloc.alloc_pages_with_owners([0] * (total // cp_size)).view(-1, page_size)[:, 0].div(
                page_size, rounding_mode="floor").tolist()

            def lane_reclaim(lane, pages):
                freed = 0
                while alloc.lane_available_pages()[lane] < pages and held:
                    alloc.free_mirrored(torch.tensor([held.pop()]))
                    freed += 1
                return freed

            alloc.lane_reclaim = lane_reclaim
        return alloc, held

    cases = (
        ("alloc_plain", None, False),
        ("alloc_host_biased", [0] * cp_size, False),
        ("alloc_biased_reclaim_every_page", [0] + [10**6] * (cp_size - 1), True),
    )
    for name, bias, reclaim in cases:
        alloc, held = make(bias, reclaim)

        def once():
            got = alloc.alloc_mirrored(num_pages * page_size)
            if reclaim:  # hand the pages back to the "cache", lane 0 empty again
                held.extend(got.pages.tolist())
                alloc.merge_free()
            else:
                alloc.free_mirrored(got.pages)

        p50, p80 = _time_us(once, 300)
        assert (alloc.lane_reclaims > 0) == reclaim and alloc.uneven_picks == 0
        rows.append((name, page_size, cp_size, num_pages * page_size, "", p50, p80))


def bench_host_eviction(rows: list, num_leaves: int, evict_k: int = 100, rounds: int = 5) -> None:
    page_size, cp_size = 64, 4
    samples = []
    for r in range(rounds):
        root = Node(key=(), value=torch.empty(0))
        index = HostLeafIndex(lambda n: n.last_access)
        owners = torch.zeros(page_size, dtype=torch.int64)
        for i in range(num_leaves):
            node = Node(key=(i,), parent=root, last_access=(i * 7919) % num_leaves, id=i)
            root.children[i] = node
            set_host_state(
                node,
                CpHiCacheNodeMetadata._trusted(page_size, torch.arange(page_size), torch.arange(page_size), owners),
            )
            index.add(node)
        t0 = time.perf_counter()
        res = evict_host_slots(
            index, evict_k * page_size, cp_rank=0, child_key=lambda k: k[0], free_host=lambda i: None
        )
        samples.append((time.perf_counter() - t0) * 1e6)
        assert res.nodes_evicted == evict_k
    samples.sort()
    p50 = statistics.median(samples)
    rows.append(("host_eviction_k100", page_size, cp_size, "", num_leaves, p50, samples[-1]))
    # Baseline: a heap of every host leaf rebuilt per call (the naive approach).
    leaves = [(((i * 7919) % num_leaves), i) for i in range(num_leaves)]
    base = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        heap = list(leaves)
        heapq.heapify(heap)
        for _ in range(evict_k):
            heapq.heappop(heap)
        base.append((time.perf_counter() - t0) * 1e6)
    base.sort()
    rows.append(("rebuild_heap_baseline_k100", page_size, cp_size, "", num_leaves, statistics.median(base), base[-1]))


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None,
                    help="CSV to write (default: a new build/bench-results/bookkeeping_<UTC time>.csv)")
    args = ap.parse_args(argv)
    args.out = args.out or new_out_path("bookkeeping", ".csv")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    rows: list = []
    for tokens in (64, 1024, 16384):
        for cp_size in (2, 8):
            bench_split(rows, 64, cp_size, tokens)
            bench_write(rows, 64, cp_size, tokens)
            bench_load(rows, 64, cp_size, tokens)
    for free_pages in (10**4, 10**5):
        bench_load_vs_free_pages(rows, free_pages)
    bench_alloc(rows)
    for leaves in (10**2, 10**3, 10**4, 10**5):
        bench_host_eviction(rows, leaves)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    header = ["op", "page_size", "cp_size", "tokens", "evictable_leaves", "p50_us", "p80_us", "python", "torch", "cpu"]
    meta = [platform.python_version(), torch.__version__, platform.processor() or platform.machine()]
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow([*row[:5], f"{row[5]:.1f}", f"{row[6]:.1f}", *meta])
    print(f"{'op':<28}{'P':>4}{'N':>4}{'tokens':>8}{'leaves':>13}{'p50 us':>11}{'p80 us':>11}")
    for op, p, n, t, l, p50, p80 in rows:
        print(f"{op:<28}{p:>4}{n:>4}{str(t):>8}{str(l):>13}{p50:>11.1f}{p80:>11.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
