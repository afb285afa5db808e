"""Triton page-copy kernels (run by Triton's interpreter on CPU tensors) versus
the torch reference and a page-by-page oracle: bitwise, with poisoned
destinations, guard bands and unchanged sources (see tests.helpers.kernel_pools.check_copy),
at awkward sizes, every rank of CP 1-4 and the CP 8 owner mix.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.kernel_pools import (
    HOST_LAYOUTS,
    MAIN_BUFFERS,
    PAGE_SIZES,
    POISON,
    assert_same_bytes,
    bits,
    changed_bytes,
    check_copy,
    make_pools,
    owned_count,
    page_locs,
)
from sglang_cp_hicache.kernels import _launch_spec, _triton_launch
from sglang_cp_hicache.placement import CpPlacement

# Every launch goes through the launcher, which runs CPU tensors under Triton's
# interpreter whatever TRITON_INTERPRET says: the interpreted re-run would repeat it unchanged.
pytestmark = pytest.mark.same_under_interpret

DIRECTIONS = ("d2h", "h2d")


def mixed_batch(placement: CpPlacement, dev_pages: int, host_pages: int, seed: int, max_owned: int = 3):
    """A shuffled mix of owned and foreign logical pages that includes this
    rank's last page of the pool, mapped to shuffled host pages that include
    the last host page."""
    n, r = placement.cp_size, placement.cp_rank
    rng = random.Random(seed)
    owned_all = [p for p in range(dev_pages * n) if p % n == r]
    foreign = [p for p in range(dev_pages * n) if p % n != r]
    k = min(max_owned, len(owned_all), host_pages)
    owned = rng.sample(owned_all[:-1], k - 1) + [owned_all[-1]]
    pages = owned + rng.sample(foreign, min(2, len(foreign)))
    rng.shuffle(pages)
    hosts = rng.sample(range(host_pages - 1), k - 1) + [host_pages - 1]
    rng.shuffle(hosts)
    return pages, hosts


# ----------------------------------------------------------------------------- the full matrix
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kind", MAIN_BUFFERS)
def test_matches_reference(kind, page_size, host_layout, direction):
    placement = CpPlacement(page_size, 3, 1)
    pools = make_pools(kind, page_size, host_layout, placement, direction=direction, seed=page_size)
    pages, hosts = mixed_batch(placement, dev_pages=5, host_pages=6, seed=7)
    got = check_copy(
        pools, direction, page_locs(pages, page_size), page_locs(hosts, page_size), layer_id=2
    )
    # something was copied: the destination is no longer all poison
    dst = got.host_big if direction == "d2h" else got.dev_bigs[2]
    assert changed_bytes(dst, pools.host_big if direction == "d2h" else pools.dev_bigs[2]) > 0


# ----------------------------------------------------------------------------- edge cases
EDGE = [("indexer", 64), ("kv_fp8", 16), ("kv_bf16", 1)]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind,page_size", EDGE)
@pytest.mark.parametrize("cp_size,cp_rank,pages", [(2, 1, []), (4, 2, [0, 1, 3, 5, 7, 19])],
                         ids=["empty", "foreign-only"])
def test_batches_without_owned_pages_touch_nothing(kind, page_size, host_layout, direction, cp_size, cp_rank, pages):
    """An empty batch, and one of pages other ranks own (none is 2 mod 4), change no byte."""
    placement = CpPlacement(page_size, cp_size, cp_rank)
    pools = make_pools(kind, page_size, host_layout, placement, direction=direction)
    got = check_copy(pools, direction, page_locs(pages, page_size), torch.zeros(0, dtype=torch.int64))
    assert_same_bytes(got, pools, f"{len(pages)} pages, none owned")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind,page_size", EDGE)
def test_one_page_at_the_end_of_both_pools(kind, page_size, host_layout, direction):
    """The last physical device page and the last host page sit next to the
    guard bands: exactly one page per layer changes, nothing else."""
    placement = CpPlacement(page_size, 2, 1)
    dev_pages, host_pages = 5, 6
    pools = make_pools(
        kind, page_size, host_layout, placement, direction=direction,
        dev_pages=dev_pages, host_pages=host_pages,
    )
    last_logical = (dev_pages - 1) * 2 + 1  # physical page dev_pages - 1 on rank 1
    got = check_copy(
        pools, direction, page_locs([last_logical], page_size), page_locs([host_pages - 1], page_size),
        layer_id=1,
    )
    row_bytes = pools.devs[0][0].numel() * pools.devs[0].element_size()
    page_bytes = row_bytes * (page_size if pools.kv else 1)
    if direction == "d2h":
        assert changed_bytes(got.host_big, pools.host_big) <= page_bytes * pools.num_layers
        host_pages_view = bits(got.host)
        assert bool((host_pages_view != POISON).any())
    else:
        dev = got.devs[1]
        last = dev[-page_size:] if pools.kv else dev[-1:]
        assert not bool((bits(last) == POISON).all())
        assert bool((bits(dev[: -page_size if pools.kv else -1]) == POISON).all())


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("cp_size,cp_rank", [(n, r) for n in (1, 2, 3, 4) for r in range(n)])
def test_every_rank_of_cp_1_to_4(cp_size, cp_rank, direction):
    placement = CpPlacement(16, cp_size, cp_rank)
    pools = make_pools("kv_fp8", 16, "page_first", placement, direction=direction, dev_pages=4, host_pages=5)
    pages, hosts = mixed_batch(placement, dev_pages=4, host_pages=5, seed=cp_size * 10 + cp_rank)
    check_copy(pools, direction, page_locs(pages, 16), page_locs(hosts, 16), layer_id=cp_rank % 3)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("num_ctas", [1, 3, 8, 64])
def test_persistent_grid_counts_owned_pages_ahead(num_ctas, direction):
    """40 pages over up to 8 programs: later programs count >16 owned-or-not
    pages ahead of their chunk (several steps of the counting loop)."""
    placement = CpPlacement(1, 3, 2)
    pools = make_pools("indexer", 1, "layer_first", placement, direction=direction,
                       num_layers=2, dev_pages=20, host_pages=20)
    rng = random.Random(num_ctas)
    pages = rng.sample(range(60), 40)
    hosts = rng.sample(range(20), owned_count(pages, placement))
    check_copy(pools, direction, page_locs(pages, 1), page_locs(hosts, 1), layer_id=1, num_ctas=num_ctas)


@pytest.mark.parametrize("num_ctas", [1, 2, 5])
def test_backup_splits_layers_across_programs(num_ctas):
    """One page, six layers: the grid splits the layers instead."""
    placement = CpPlacement(16, 2, 0)
    pools = make_pools("kv_bf16", 16, "layer_first", placement, direction="d2h", num_layers=6)
    check_copy(pools, "d2h", page_locs([4], 16), page_locs([2], 16), num_ctas=num_ctas)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    "kind,page_size,guard_rows",
    [("kv_odd", 4, 1), ("kv_fp8", 4, 1), ("indexer", 1, 1), ("kv_bf16", 2, 3)],
)
def test_unaligned_and_odd_rows_fall_back_to_narrow_words(kind, page_size, guard_rows, direction):
    placement = CpPlacement(page_size, 2, 0)
    pools = make_pools(kind, page_size, "page_first", placement, direction=direction, dev_guard_rows=guard_rows)
    pages, hosts = mixed_batch(placement, dev_pages=5, host_pages=6, seed=3)
    check_copy(pools, direction, page_locs(pages, page_size), page_locs(hosts, page_size), layer_id=0)


def test_block_smaller_than_page_loops_within_the_page():
    placement = CpPlacement(16, 2, 1)
    for direction in DIRECTIONS:
        pools = make_pools("kv_bf16", 16, "page_first", placement, direction=direction)
        pages, hosts = mixed_batch(placement, dev_pages=5, host_pages=6, seed=5)
        check_copy(pools, direction, page_locs(pages, 16), page_locs(hosts, 16), layer_id=1, block_bytes=256)


def test_tile_shape_packs_page_units_into_tiles():
    ts = _launch_spec.tile_shape
    T = _launch_spec.TileShape
    # 32 KiB tiles of int64 words (4,096 words)
    assert ts(8448 // 8, 8, 32768) == T(16, 256)  # indexer page: 5 units of 256 words, 16 per tile
    assert ts(41984 // 8, 8, 32768) == T(16, 256)  # fp8 KV page: 21 units
    assert ts(73728 // 8, 8, 32768) == T(4, 1024)  # bf16 KV page: 9 units, exact
    assert ts(33, 4, 32768) == T(16, 64)  # 132-byte page: one unit, 16 pages per tile
    assert ts(13, 1, 32768) == T(16, 16)
    assert ts(1, 8, 16) == T(2, 1)
    for page_words in (1, 7, 33, 1056, 5248, 9216):
        for block in (16, 256, 4096, 32768):
            t = ts(page_words, 8, block)
            assert t.pages * t.words * 8 <= max(block, 8), (page_words, block, t)
            assert t.pages <= _triton_launch.MAX_TILE_PAGES


def test_several_indexer_pages_per_tile_and_several_tiles_per_walk_block():
    """20 owned 8,448-byte pages in one walk block: 16 x 256-word tiles, each
    holding units of several pages, a 2-deep pipeline over many tiles."""
    placement = CpPlacement(64, 2, 0)
    for direction in DIRECTIONS:
        pools = make_pools("indexer", 64, "page_first", placement, direction=direction, num_layers=2,
                           dev_pages=24, host_pages=24)
        rng = random.Random(5)
        pages = rng.sample(range(48), 40)
        hosts = rng.sample(range(24), owned_count(pages, placement))
        assert len(hosts) >= 17
        check_copy(pools, direction, page_locs(pages, 64), page_locs(hosts, 64), layer_id=1, num_ctas=1)


@pytest.mark.parametrize("num_ctas", [1, 2, 7])
def test_cp8_real_owner_mix_across_walk_and_count_blocks(num_ctas):
    """CP 8 with pages assigned round-robin to owners (7 of 8 foreign), 2,100
    pages in shuffled order: a program walks several WALK_PAGES blocks and,
    with 2 CTAs, counts more than COUNT_PAGES pages ahead of its chunk."""
    placement = CpPlacement(1, 8, 5)
    num_pages = 2100
    assert num_pages // 2 > _triton_launch.COUNT_PAGES and num_pages // 7 > _triton_launch.WALK_PAGES
    pool = num_pages // 8 + 1
    pools = make_pools("indexer", 1, "layer_first", placement, direction="h2d", num_layers=2,
                       dev_pages=pool, host_pages=pool)
    rng = random.Random(num_ctas)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    owned = owned_count(pages, placement)
    assert owned == (num_pages - 5 + 7) // 8
    hosts = rng.sample(range(pool), owned)
    check_copy(pools, "h2d", page_locs(pages, 1), page_locs(hosts, 1), layer_id=1, num_ctas=num_ctas)


def test_word_plan():
    wp = _launch_spec.word_plan
    assert wp(656, (656 * 64, 656), (4096, 8192)) == _launch_spec.WordPlan(8, 2)
    assert wp(1152, (1152,), (4096,)) == _launch_spec.WordPlan(8, 2)
    assert wp(132, (132,), (4096,)) == _launch_spec.WordPlan(4, 1)
    assert wp(8448, (8448,), (4096 + 8,)) == _launch_spec.WordPlan(8, 1)
    assert wp(13, (13,), (4096,)) == _launch_spec.WordPlan(1, 1)


# ----------------------------------------------------------------------------- random cases
@st.composite
def copy_cases(draw):
    kind = draw(st.sampled_from(("indexer", "kv_fp8", "kv_bf16")))
    page_size = draw(st.sampled_from((1, 2, 4, 16)))
    cp_size = draw(st.integers(1, 4))
    cp_rank = draw(st.integers(0, cp_size - 1))
    host_layout = draw(st.sampled_from(HOST_LAYOUTS))
    direction = draw(st.sampled_from(DIRECTIONS))
    num_layers = draw(st.integers(1, 3))
    dev_pages = draw(st.integers(1, 5))
    host_pages = draw(st.integers(1, 6))
    pool_pages = dev_pages * cp_size
    pages = draw(st.lists(st.integers(0, pool_pages - 1), unique=True, max_size=min(pool_pages, 8)))
    placement = CpPlacement(page_size, cp_size, cp_rank)
    n_owned = owned_count(pages, placement)
    if n_owned > host_pages:  # keep only as many owned pages as host pages exist
        keep, seen = [], 0
        for p in pages:
            if p % cp_size == cp_rank:
                if seen == host_pages:
                    continue
                seen += 1
            keep.append(p)
        pages, n_owned = keep, host_pages
    hosts = draw(st.permutations(range(host_pages)))[:n_owned]
    return dict(
        kind=kind, page_size=page_size, placement=placement, host_layout=host_layout, direction=direction,
        num_layers=num_layers, dev_pages=dev_pages, host_pages=host_pages, pages=pages, hosts=hosts,
        layer_id=draw(st.integers(0, num_layers - 1)),
        num_ctas=draw(st.integers(1, 6)),
        guard_rows=draw(st.sampled_from((0, 1, page_size))),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=30, deadline=None, derandomize=True)
@given(copy_cases())
def test_random_cases(case):
    pools = make_pools(
        case["kind"], case["page_size"], case["host_layout"], case["placement"],
        num_layers=case["num_layers"], dev_pages=case["dev_pages"], host_pages=case["host_pages"],
        direction=case["direction"], dev_guard_rows=case["guard_rows"], seed=case["seed"],
    )
    p = case["page_size"]
    check_copy(
        pools, case["direction"], page_locs(case["pages"], p), page_locs(case["hosts"], p),
        layer_id=case["layer_id"], num_ctas=case["num_ctas"],
    )
