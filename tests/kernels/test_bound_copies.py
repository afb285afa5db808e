"""Bound copies (kernels.bound.PoolCopies): the same bytes as the unbound
copies of kernels.transfer on both CPU backends (poisoned destinations, guard
bands, awkward sizes, odd alignment), buffers refused at bind time naming the
argument, per-call refusal of bad layer ids and index tensors with nothing
written, no geometry work per call, and the shared copy counters."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tests.helpers.kernel_pools import (
    HOST_LAYOUTS, POISON, Pools, assert_same_bytes, bits, make_pools, page_locs, run_oracle, small_buffers,
)
from sglang_cp_hicache.kernels import DEBUG_ENV, _checks, _launch_spec, transfer
from sglang_cp_hicache.kernels.bound import PoolCopies, bind_indexer_copies, bind_kv_copies
from sglang_cp_hicache.placement import CpPlacement, page_owner

# Every test picks its backend itself (TRITON_INTERPRET set or removed per test) or
# calls the launcher, which interprets CPU tensors whatever the variable says:
# the interpreted re-run would repeat it unchanged.
pytestmark = pytest.mark.same_under_interpret

I64 = torch.int64
BACKENDS = [pytest.param(None, id="reference"), pytest.param("1", id="interpret")]


def _backend(monkeypatch, interpret: str | None) -> None:
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)


def bind(pools: Pools) -> PoolCopies:
    fn = bind_kv_copies if pools.kv else bind_indexer_copies
    return fn(pools.devs, pools.host, pools.host_layout, pools.placement)


def run_bound(copies: PoolCopies, direction: str, dl, hl, layer_id: int) -> None:
    if direction == "d2h":
        copies.backup(dl, hl)
    else:
        copies.load(layer_id, dl, hl)


def run_unbound(pools: Pools, direction: str, dl, hl, layer_id: int) -> None:
    placement, h = pools.placement, pools.host_layout
    if pools.kv and direction == "d2h":
        transfer.backup_kv_all_layers(pools.devs, pools.host, h, dl, hl, placement)
    elif pools.kv:
        transfer.load_kv_one_layer(pools.devs[layer_id], pools.host, h, layer_id, dl, hl, placement)
    elif direction == "d2h":
        transfer.backup_indexer_all_layers(pools.devs, pools.host, h, dl, hl, placement)
    else:
        transfer.load_indexer_one_layer(pools.devs[layer_id], pools.host, h, layer_id, dl, hl, placement)


def batch(placement: CpPlacement, num_pages: int, dev_pages: int, host_pages: int, seed: int):
    """``num_pages`` distinct logical pages in shuffled order, about 1/N of
    them (at least one) owned by this rank, and shuffled host pages for those."""
    rng = random.Random(seed)
    n, r = placement.cp_size, placement.cp_rank
    pool = rng.sample(range(dev_pages * n), dev_pages * n)
    k = min(dev_pages, host_pages, max(1, round(num_pages / n)))
    owned = [p for p in pool if page_owner(p, n) == r][:k]
    pages = owned + [p for p in pool if page_owner(p, n) != r][: num_pages - k]
    rng.shuffle(pages)
    return page_locs(pages, placement.page_size), page_locs(rng.sample(range(host_pages), k), placement.page_size)


# ----------------------------------------------------------------------------- same bytes
@pytest.mark.parametrize("interpret", BACKENDS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind,page_size,num_pages,guard_rows", [
    ("indexer", 1, 15, 1),
    ("indexer", 16, 1, 2),
    ("kv_fp8", 16, 7, 1),  # odd guard: device layers off 16-byte alignment
    ("kv_bf16", 1, 15, 0),
    ("kv_odd", 2, 9, 1),  # 13-byte rows: byte-wide words
])
def test_bound_copies_match_the_unbound_ones(monkeypatch, interpret, direction, host_layout, kind, page_size,
                                             num_pages, guard_rows):
    _backend(monkeypatch, interpret)
    placement = CpPlacement(page_size, 3, 1)
    pools = make_pools(kind, page_size, host_layout, placement, num_layers=3, dev_pages=6, host_pages=7,
                       direction=direction, dev_guard_rows=guard_rows, seed=num_pages)
    dl, hl = batch(placement, num_pages, dev_pages=6, host_pages=7, seed=page_size)
    assert dl.numel() == num_pages * page_size and 0 < hl.numel() <= dl.numel()
    for layer_id in (0, 2) if direction == "h2d" else (0,):
        got, want, oracle = pools.clone(), pools.clone(), pools.clone()
        run_bound(bind(got), direction, dl, hl, layer_id)
        run_unbound(want, direction, dl, hl, layer_id)
        run_oracle(oracle, direction, dl, hl, layer_id)
        assert_same_bytes(got, want, "bound vs unbound")
        assert_same_bytes(got, oracle, "bound vs page oracle")
        # the copy wrote something, and the guard bands kept their poison
        dst, src = (got.host_big, pools.host_big) if direction == "d2h" else (got.dev_bigs[layer_id],
                                                                               pools.dev_bigs[layer_id])
        assert not torch.equal(bits(dst), bits(src))
        masks = got.interior_masks()
        mask = masks[1] if direction == "d2h" else masks[0][layer_id]
        guard = bits(dst)[~_byte_mask(mask, dst)]
        assert guard.numel() > 0 or guard_rows == 0 and direction == "h2d"
        assert bool((guard == POISON).all())


def _byte_mask(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return mask.repeat_interleave(t.element_size(), dim=-1) if t.element_size() > 1 else mask


@pytest.mark.parametrize("interpret", BACKENDS)
def test_geometry_is_not_derived_again_per_call(monkeypatch, interpret):
    """After binding, a copy derives no host geometry and checks no buffer:
    only the index tensors."""
    _backend(monkeypatch, interpret)
    placement = CpPlacement(4, 2, 0)
    kv = make_pools("kv_bf16", 4, "page_first", placement, direction="d2h")
    idx = make_pools("indexer", 4, "layer_first", placement, direction="d2h")
    kv_copies, idx_copies = bind(kv), bind(idx)

    def refuse(*a, **k):
        raise AssertionError("buffer geometry checked again on a bound copy")

    for name in ("check_backup_pool", "check_load_pool", "host_kv_geometry", "host_index_geometry",
                 "check_device_layers", "check_device_layer", "check_kv_call", "check_index_call"):
        monkeypatch.setattr(_checks, name, refuse)
    monkeypatch.setattr(_launch_spec, "pool_part", refuse)
    dl, hl = page_locs([0, 1, 2], 4), page_locs([3, 1], 4)
    kv_copies.backup(dl, hl)
    kv_copies.load(1, dl, hl)
    idx_copies.backup(dl, hl)
    idx_copies.load(2, dl, hl)


def test_bound_copies_count_like_the_unbound_ones(monkeypatch):
    _backend(monkeypatch, None)
    placement = CpPlacement(4, 2, 1)
    kv = make_pools("kv_fp8", 4, "layer_first", placement, direction="d2h")
    idx = make_pools("indexer", 4, "page_first", placement, direction="d2h")
    dl, hl = page_locs([3, 4, 9, 0], 4), page_locs([5, 1], 4)  # owned: 3, 9
    transfer.reset_copy_stats()
    bind(kv).backup(dl, hl)
    bind(kv).load(2, dl, hl)
    bind(idx).load(0, page_locs([0, 2], 4), torch.zeros(0, dtype=I64))  # nothing owned: still a call
    assert transfer.copy_stats() == transfer.CopyStats(
        backend="reference", kv_backup_calls=1, kv_load_calls=1, indexer_load_calls=1, cp_size=2, pages_copied=4,
    )
    _backend(monkeypatch, "1")
    bind(idx).backup(dl, hl)
    stats = transfer.copy_stats()
    assert (stats.backend, stats.indexer_backup_calls, stats.pages_copied) == ("triton-interpret", 1, 6)
    with pytest.raises(ValueError):
        bind(idx).backup(dl, hl[:4])
    assert transfer.copy_stats() == stats  # a refused call is not counted
    transfer.reset_copy_stats()


# ----------------------------------------------------------------------------- bind-time refusals
P = 4
PLACEMENT = CpPlacement(P, 2, 0)
BF16 = torch.bfloat16


def kv_bind(**over):
    return {**small_buffers("kv", P), "placement": PLACEMENT, **over}


def index_bind(**over):
    return {**small_buffers("indexer", P), "placement": PLACEMENT, **over}


BAD_BINDS = [
    (kv_bind, dict(host_kv=torch.zeros(2, 3 * P, 1, 8, dtype=torch.float16)), TypeError, "host_kv"),
    (kv_bind, dict(host_kv=torch.zeros(2, 3 * P, 1, 9, dtype=BF16)), ValueError, "host_kv"),
    (kv_bind, dict(host_kv=torch.zeros(3 * P, 2, 8, dtype=BF16)), ValueError, "host_kv"),
    (kv_bind, dict(host_kv=torch.zeros(1, 3 * P, 1, 8, dtype=BF16)), ValueError, "device_kv"),
    (kv_bind, dict(host_kv="buffer"), TypeError, "host_kv"),
    (kv_bind, dict(host_kv=torch.zeros(2, 3 * P, 1, 16, dtype=BF16)[..., ::2]), ValueError, "host_kv"),
    (kv_bind, dict(device_kv=[]), ValueError, "device_kv"),
    (kv_bind, dict(device_kv=torch.zeros(2, 4 * P, 1, 8, dtype=BF16)), TypeError, "device_kv"),
    (kv_bind, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=BF16), torch.zeros(5 * P, 1, 8, dtype=BF16)]),
     ValueError, "device_kv[1]"),
    (kv_bind, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=BF16), torch.zeros(4 * P, 1, 16, dtype=BF16)[..., ::2]]),
     ValueError, "device_kv[1]"),
    (kv_bind, dict(device_kv=[torch.zeros(4 * P, 8, dtype=BF16)]), ValueError, "device_kv[0]"),
    (kv_bind, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=BF16, device="meta")]), ValueError, "device_kv[0]"),
    (kv_bind, dict(host_layout="page_last"), ValueError, "host_layout"),
    (kv_bind, dict(placement=(4, 2, 0)), TypeError, "placement"),
    (index_bind, dict(host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.int8)), TypeError, "host_index"),
    (index_bind, dict(host_index=torch.zeros(3, 2, 132 * P, dtype=torch.uint8)), ValueError, "host_index"),
    (index_bind, dict(host_layout="layer_first"), ValueError, "host_index"),
    (index_bind, dict(device_index=[torch.zeros(4, 132 * P, dtype=torch.int8)] * 2,
                      host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.int8)), TypeError, "device_index[0]"),
    (index_bind, dict(device_index=[torch.zeros(4, 1, 132 * P, dtype=torch.uint8)] * 2), ValueError,
     "device_index[0]"),
    (index_bind, dict(device_index=[torch.zeros(4, 132 * P, dtype=torch.uint8)] * 3), ValueError, "device_index"),
]


@pytest.mark.parametrize("build,over,exc,name", BAD_BINDS)
def test_bad_buffers_are_refused_at_bind_time(build, over, exc, name):
    fn = bind_kv_copies if build is kv_bind else bind_indexer_copies
    with pytest.raises(exc) as info:
        fn(**build(**over))
    assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", str(info.value)), str(info.value)


# ----------------------------------------------------------------------------- per-call refusals
def _filled(build, **over) -> dict:
    args = build(**over)
    gen = torch.Generator().manual_seed(1)
    for t in [*args.get("device_kv", args.get("device_index")), args.get("host_kv", args.get("host_index"))]:
        bits(t).copy_(torch.randint(0, 256, bits(t).shape, dtype=torch.uint8, generator=gen))
    return args


def _buffers(args: dict) -> list[torch.Tensor]:
    return [bits(t).clone() for t in [*args.get("device_kv", args.get("device_index")),
                                      args.get("host_kv", args.get("host_index"))]]


GOOD_DL, GOOD_HL = page_locs([0, 1, 2], P), page_locs([0, 2], P)  # rank 0 owns 0, 2
BAD_CALLS = [
    # (device_locs, host_locs, exception, message start)
    (GOOD_DL.to(torch.int32), GOOD_HL, TypeError, "device_locs must be int64"),
    (GOOD_DL, GOOD_HL.float(), TypeError, "host_locs must be int64"),
    (GOOD_DL.view(3, P), GOOD_HL, ValueError, "device_locs must be 1-D"),
    (torch.arange(10, dtype=I64), GOOD_HL, ValueError, "device_locs has 10 entries"),
    (GOOD_DL, page_locs([0, 1, 2, 3], P), ValueError, "host_locs has 16 entries, more than"),
    (GOOD_DL - 2 * P, GOOD_HL, ValueError, "device_locs holds negative locations"),
    (GOOD_DL, GOOD_HL - 4 * P, ValueError, "host_locs holds negative locations"),
    (torch.tensor([2, 3, 4, 5, 10, 11, 12, 13]), page_locs([0], P), ValueError, "device_locs must list whole pages"),
    (GOOD_DL, GOOD_HL.flip(0).contiguous(), ValueError, "host_locs must list whole pages"),
    (page_locs([0, 1, 8], P), GOOD_HL, ValueError, "device_locs maps to physical page 4"),
    (GOOD_DL, page_locs([0, 3], P), ValueError, "host_locs reaches host page 3"),
    (GOOD_DL, page_locs([0], P), ValueError, "host_locs has 4 entries but device_locs holds 8"),
]


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("interpret", BACKENDS)
@pytest.mark.parametrize("build", [kv_bind, index_bind], ids=["kv", "indexer"])
@pytest.mark.parametrize("dl,hl,exc,message", BAD_CALLS)
def test_bad_index_tensors_are_refused_per_call(monkeypatch, build, interpret, debug, dl, hl, exc, message):
    """Same error as the unbound copy, naming the argument; nothing written."""
    _backend(monkeypatch, interpret)
    monkeypatch.setenv(DEBUG_ENV, debug)
    args = _filled(build)
    copies = (bind_kv_copies if build is kv_bind else bind_indexer_copies)(**args)
    before = _buffers(args)
    for call in (lambda: copies.backup(dl, hl), lambda: copies.load(1, dl, hl)):
        with pytest.raises(exc) as info:
            call()
        assert str(info.value).startswith(message), str(info.value)
        assert all(torch.equal(a, b) for a, b in zip(before, _buffers(args))), "a refused call wrote something"
    layers = args.get("device_kv", args.get("device_index"))
    host, host_layout = args.get("host_kv", args.get("host_index")), args["host_layout"]
    unbound = transfer.backup_kv_all_layers if build is kv_bind else transfer.backup_indexer_all_layers
    with pytest.raises(exc) as info:
        unbound(layers, host, host_layout, dl, hl, PLACEMENT)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("interpret", BACKENDS)
@pytest.mark.parametrize("layer_id,exc", [(2, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError)])
def test_bad_layer_id_is_refused_per_call(monkeypatch, interpret, layer_id, exc):
    _backend(monkeypatch, interpret)
    args = _filled(kv_bind)
    copies = bind_kv_copies(**args)
    before = _buffers(args)
    with pytest.raises(exc, match="^layer_id "):
        copies.load(layer_id, GOOD_DL, GOOD_HL)
    assert all(torch.equal(a, b) for a, b in zip(before, _buffers(args)))


def test_index_tensors_must_sit_with_the_device_buffers_for_the_kernel(monkeypatch):
    _backend(monkeypatch, "1")
    copies = bind_kv_copies(**_filled(kv_bind))
    with pytest.raises(ValueError, match="^device_locs is on meta"):
        copies.backup(GOOD_DL.to("meta"), GOOD_HL)
    with pytest.raises(ValueError, match="^host_locs must be contiguous"):
        copies.backup(GOOD_DL, page_locs([0, 1, 2, 3], P)[::2])


@pytest.mark.parametrize("foreign_only", [False, True])
def test_empty_batches_return_before_launching(monkeypatch, foreign_only):
    _backend(monkeypatch, "1")
    copies = bind_indexer_copies(**_filled(index_bind))

    def no_launch(*a, **k):
        raise AssertionError("launched a kernel for an empty batch")

    monkeypatch.setattr(_launch_spec, "run", no_launch)
    empty = torch.zeros(0, dtype=I64)
    dl = page_locs([1, 3], P) if foreign_only else empty  # rank 0 owns neither
    copies.backup(dl, empty)
    copies.load(0, dl, empty)
    with pytest.raises(AssertionError, match="launched"):
        copies.backup(GOOD_DL, GOOD_HL)
