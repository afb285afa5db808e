"""Argument checks: each bad input raises TypeError/ValueError naming the
argument and writes nothing; both CPU backends refuse the same bad index
values with the same message; empty batches return before any launch; on the
device (indices unchecked) out-of-range and negative pages are skipped."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.kernel_pools import (
    POISON, assert_same_bytes, bits, changed_bytes, make_pools, page_locs, run_triton, small_buffers,
)
from sglang_cp_hicache.kernels import DEBUG_ENV, _checks, _triton_launch, reference, transfer
from sglang_cp_hicache.placement import CpPlacement

P = 4
PLACEMENT = CpPlacement(P, 2, 0)
I64 = torch.int64


def _with_locs(buffers: dict, over: dict) -> dict:
    return {**buffers, "device_locs": page_locs([0, 1, 2], P), "host_locs": page_locs([0, 2], P),
            "placement": PLACEMENT, **over}


def _one_layer(args: dict, dev: str, device_layer: int, layer_id: int, over: dict) -> dict:
    """The load twin of backup ``args``: layer ``device_layer`` of ``args[dev]``, host layer ``layer_id``."""
    layers = args.pop(dev)
    return {f"{dev}_layer": layers[device_layer], **args, "layer_id": layer_id, **over}


def kv_args(**over):
    """Valid backup_kv_all_layers arguments: 2 layers, 4 device pages, 3 host pages."""
    return _with_locs(small_buffers("kv", P), over)


def load_kv_args(**over):
    return _one_layer(kv_args(), "device_kv", 0, 1, over)


def index_args(**over):
    return _with_locs(small_buffers("indexer", P), over)


def load_index_args(**over):
    return _one_layer(index_args(), "device_index", 1, 0, over)


BACKUP_KV = (_triton_launch.backup_kv_all_layers, reference.backup_kv_all_layers_reference)
LOAD_KV = (_triton_launch.load_kv_one_layer, reference.load_kv_one_layer_reference)
BACKUP_IDX = (_triton_launch.backup_indexer_all_layers, reference.backup_indexer_all_layers_reference)
LOAD_IDX = (_triton_launch.load_indexer_one_layer, reference.load_indexer_one_layer_reference)

# (functions, args builder, overrides, exception, argument name in the message)
# Checked on the Triton launcher and, unless the argument is the launcher's
# own (num_ctas, block_bytes: both=False), on the reference too.
BAD = [
    (BACKUP_KV, kv_args, dict(host_kv=torch.zeros(2, 3 * P, 1, 8, dtype=torch.float16)), TypeError, "host_kv", True),
    (BACKUP_KV, kv_args, dict(host_kv=torch.zeros(2, 3 * P, 1, 9, dtype=torch.bfloat16)), ValueError, "host_kv", True),
    (BACKUP_KV, kv_args, dict(host_kv=torch.zeros(3 * P, 2, 8, dtype=torch.bfloat16)), ValueError, "host_kv", True),
    (BACKUP_KV, kv_args, dict(host_kv=torch.zeros(1, 3 * P, 1, 8, dtype=torch.bfloat16)), ValueError, "device_kv", True),
    (BACKUP_KV, kv_args, dict(host_kv="buffer"), TypeError, "host_kv", True),
    (BACKUP_KV, kv_args, dict(device_kv=[]), ValueError, "device_kv", True),
    (BACKUP_KV, kv_args, dict(device_kv=torch.zeros(2, 4 * P, 1, 8)), TypeError, "device_kv", True),
    (BACKUP_KV, kv_args, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=torch.bfloat16),
                                         torch.zeros(5 * P, 1, 8, dtype=torch.bfloat16)]), ValueError, "device_kv[1]", True),
    (BACKUP_KV, kv_args, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=torch.bfloat16),
                                         torch.zeros(4 * P, 1, 16, dtype=torch.bfloat16)[..., ::2]]), ValueError, "device_kv[1]", True),
    (BACKUP_KV, kv_args, dict(device_kv=[torch.zeros(4 * P, 8, dtype=torch.bfloat16)]), ValueError, "device_kv[0]", True),
    (BACKUP_KV, kv_args, dict(host_kv=torch.zeros(2, 3 * P, 1, 16, dtype=torch.bfloat16)[..., ::2]), ValueError, "host_kv", True),
    (BACKUP_KV, kv_args, dict(host_layout="page_last"), ValueError, "host_layout", True),
    (BACKUP_KV, kv_args, dict(placement=(4, 2, 0)), TypeError, "placement", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2], P).to(torch.int32)), TypeError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(host_locs=page_locs([0, 2], P).float()), TypeError, "host_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2], P).view(3, P)), ValueError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=torch.arange(10, dtype=I64)), ValueError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(host_locs=torch.arange(6, dtype=I64)), ValueError, "host_locs", True),
    (BACKUP_KV, kv_args, dict(host_locs=page_locs([0, 1, 2, 3], P)), ValueError, "host_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2, 3], P)[::2]), ValueError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2], P).to("meta")), ValueError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=torch.bfloat16, device="meta")]),
     ValueError, "device_kv[0]", True),
    (BACKUP_KV, kv_args, dict(num_ctas=0), ValueError, "num_ctas", False),
    (BACKUP_KV, kv_args, dict(block_bytes=100), ValueError, "block_bytes", False),
    (LOAD_KV, load_kv_args, dict(layer_id=2), ValueError, "layer_id", True),
    (LOAD_KV, load_kv_args, dict(layer_id=-1), ValueError, "layer_id", True),
    (LOAD_KV, load_kv_args, dict(layer_id=True), TypeError, "layer_id", True),
    (LOAD_KV, load_kv_args, dict(device_kv_layer=torch.zeros(4 * P, 1, 8)), TypeError, "device_kv_layer", True),
    (LOAD_KV, load_kv_args, dict(device_kv_layer=torch.zeros(4 * P, 1, 16, dtype=torch.bfloat16)[..., :8]), ValueError, "device_kv_layer", True),
    (LOAD_KV, load_kv_args, dict(host_locs=page_locs([0, 2], P).to("meta")), ValueError, "host_locs", True),
    (BACKUP_IDX, index_args, dict(host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.int8)), TypeError, "host_index", True),
    (BACKUP_IDX, index_args, dict(host_index=torch.zeros(3, 2, 132 * P, dtype=torch.uint8)), ValueError, "host_index", True),
    (BACKUP_IDX, index_args, dict(device_index=[torch.zeros(4, 132 * P, dtype=torch.int8)] * 2,
                                  host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.int8)), TypeError, "device_index[0]", True),
    (BACKUP_IDX, index_args, dict(device_index=[torch.zeros(4, 1, 132 * P, dtype=torch.uint8)] * 2), ValueError, "device_index[0]", True),
    (LOAD_IDX, load_index_args, dict(layer_id=5), ValueError, "layer_id", True),
    (LOAD_IDX, load_index_args, dict(host_layout="layer_first"), ValueError, "host_index", True),
]


# The reference refuses what the launchers refuse (contiguity, device, dense
# host rows included); only the launch tuning is the launchers' alone.
BAD_CASES = [
    pytest.param(fns[impl], build, over, exc, name, id=f"{impl and 'reference' or 'triton'}-{i}-{name}")
    for i, (fns, build, over, exc, name, both) in enumerate(BAD)
    for impl in ((0, 1) if both else (0,))
]


@pytest.mark.parametrize("fn,build,over,exc,name", BAD_CASES)
def test_bad_argument_is_named(fn, build, over, exc, name):
    with pytest.raises(exc) as info:
        fn(**build(**over))
    assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", str(info.value)), str(info.value)


@pytest.mark.parametrize("fn", [reference.backup_kv_all_layers_reference, transfer.backup_kv_all_layers])
def test_launch_tuning_is_the_launchers_alone(fn):
    """The reference and the front door take no num_ctas: TypeError naming it, nothing written."""
    args = kv_args()
    for layer in args["device_kv"]:
        layer.fill_(1.0)
    with pytest.raises(TypeError, match="'num_ctas'"):
        fn(**args, num_ctas=4)
    assert not bool(args["host_kv"].any())


def test_host_buffer_must_be_pinned_for_cuda_device_buffers():
    with pytest.raises(ValueError, match=r"^host_kv must be a pinned CPU tensor"):
        _checks.check_host_buffer("host_kv", torch.zeros(2, 4, 1, 8), torch.device("cuda", 0))


@pytest.mark.parametrize(
    "fn,build",
    [
        (_triton_launch.backup_kv_all_layers, kv_args),
        (_triton_launch.load_kv_one_layer, load_kv_args),
        (_triton_launch.backup_indexer_all_layers, index_args),
        (_triton_launch.load_indexer_one_layer, load_index_args),
    ],
)
@pytest.mark.parametrize("foreign_only", [False, True])
def test_empty_batches_return_before_launching(monkeypatch, fn, build, foreign_only):
    def no_launch(*a, **k):
        raise AssertionError("launched a kernel for an empty batch")

    monkeypatch.setattr(_triton_launch, "_launch", no_launch)
    empty = torch.zeros(0, dtype=I64)
    device_locs = page_locs([1, 3], P) if foreign_only else empty  # rank 0 owns neither
    fn(**build(device_locs=device_locs, host_locs=empty))
    with pytest.raises(AssertionError, match="launched"):
        fn(**build())  # the same call with pages does launch


def test_owned_pages_without_host_slots_are_refused_before_the_empty_return():
    """An empty host_locs returns early only once the count says nothing is owned."""
    for fn in BACKUP_KV:
        with pytest.raises(ValueError, match=r"^host_locs has 0 entries but device_locs holds 8"):
            fn(**kv_args(host_locs=torch.zeros(0, dtype=I64)))


# ----------------------------------------------------------------------------- index values
# (overrides, message start). kv_args: P=4, N=2, rank 0, 4 device pages, 3 host pages.
BAD_INDICES = [
    pytest.param(dict(device_locs=page_locs([0, 1, 2], P) - 2 * P), "device_locs holds negative locations",
                 id="negative-device"),
    pytest.param(dict(host_locs=page_locs([0, 2], P) - 4 * P), "host_locs holds negative locations",
                 id="negative-host"),
    # the owned-token count matches (4), but no page is whole: the first page
    # would be read from logical page 0 and the tail of page 1
    pytest.param(dict(device_locs=torch.tensor([2, 3, 4, 5, 10, 11, 12, 13]), host_locs=page_locs([0], P)),
                 "device_locs must list whole pages", id="unaligned-device"),
    pytest.param(dict(host_locs=page_locs([0, 2], P) + 1), "host_locs must list whole pages", id="unaligned-host"),
    pytest.param(dict(host_locs=page_locs([0, 2], P).flip(0).contiguous()), "host_locs must list whole pages",
                 id="reversed-host"),
    pytest.param(dict(device_locs=page_locs([0, 1, 8], P)), "device_locs maps to physical page 4",
                 id="device-out-of-range"),
    pytest.param(dict(host_locs=page_locs([0, 3], P)), "host_locs reaches host page 3", id="host-out-of-range"),
    pytest.param(dict(host_locs=page_locs([0], P)), "host_locs has 4 entries but device_locs holds 8",
                 id="owned-count"),
]

OPS = [
    pytest.param("backup_kv_all_layers", kv_args, id="backup_kv"),
    pytest.param("load_kv_one_layer", load_kv_args, id="load_kv"),
    pytest.param("backup_indexer_all_layers", index_args, id="backup_indexer"),
    pytest.param("load_indexer_one_layer", load_index_args, id="load_indexer"),
]


def _snapshot(args: dict) -> list[torch.Tensor]:
    out = []
    for v in args.values():
        if isinstance(v, torch.Tensor):
            out.append(bits(v.clone()))
        elif isinstance(v, list):
            out.extend(bits(t.clone()) for t in v)
    return out


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("op,build", OPS)
@pytest.mark.parametrize("over,message", BAD_INDICES)
def test_both_backends_refuse_the_same_bad_indices(monkeypatch, op, build, over, message, debug):
    """CPU indices are checked for free on both backends, debug mode or not:
    same ValueError (naming the argument), and nothing is written."""
    monkeypatch.setenv(DEBUG_ENV, debug)
    errors = {}
    for interpret in (None, "1"):
        if interpret is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
        args = build(**over)
        # fill the buffers so an unwanted copy would show
        for v in args.values():
            for t in v if isinstance(v, list) else [v]:
                if isinstance(t, torch.Tensor) and t.dtype != torch.int64:  # buffers, not indices
                    bits(t).copy_(torch.randint(0, 256, bits(t).shape, dtype=torch.uint8))
        before = _snapshot(args)
        with pytest.raises(ValueError) as info:
            getattr(transfer, op)(**args)
        after = _snapshot(args)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused call wrote something"
        errors[transfer.select_backend("cpu")] = str(info.value)
    assert set(errors) == {"reference", "triton-interpret"}
    assert errors["reference"] == errors["triton-interpret"], errors
    assert errors["reference"].startswith(message), errors["reference"]


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("fns,build", [(BACKUP_KV, kv_args), (LOAD_KV, load_kv_args), (BACKUP_IDX, index_args),
                                       (LOAD_IDX, load_index_args)])
@pytest.mark.parametrize("host_pages", [[0], [0, 2, 1]])
def test_owned_count_mismatch_is_caught_on_cpu_indices(monkeypatch, fns, build, host_pages, debug):
    """With CPU indices the count check is free, so it always runs, in both backends."""
    monkeypatch.setenv(DEBUG_ENV, debug)
    for fn in fns:
        with pytest.raises(ValueError, match=rf"^host_locs has {4 * len(host_pages)} entries but device_locs holds 8"):
            fn(**build(host_locs=page_locs(host_pages, P)))


# ----------------------------------------------------------------------------- device behaviour
def _unchecked(monkeypatch) -> None:
    """Skip the index-value checks, as a CUDA launch without debug mode does
    (reading CUDA indices would be a sync): the kernel's own guards act."""
    monkeypatch.setattr(_triton_launch, "_check_indices", lambda *a, **k: None)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("kind", ["kv_fp8", "indexer"])
def test_out_of_range_pages_are_skipped_on_the_device(monkeypatch, kind, direction):
    """Unchecked, pages beyond either pool are not copied: no byte outside the
    buffers (or anywhere) changes, and in-range pages still copy."""
    _unchecked(monkeypatch)
    placement = CpPlacement(P, 2, 1)
    pools = make_pools(kind, P, "layer_first", placement, direction=direction, dev_pages=3, host_pages=3)
    bad_dev = page_locs([7], P)  # physical page 3 of 3
    got = pools.clone()
    run_triton(got, direction, bad_dev, page_locs([0], P))
    assert_same_bytes(got, pools, "device page out of range")
    got = pools.clone()
    run_triton(got, direction, page_locs([5, 1], P), page_locs([2, 3], P))  # host page 3 of 3
    dst = got.host_big if direction == "d2h" else got.dev_bigs[0]
    src = pools.host_big if direction == "d2h" else pools.dev_bigs[0]
    assert int((bits(dst) != bits(src)).sum()) > 0  # page 5 -> host 2 copied
    fixed = pools.clone()
    run_triton(fixed, direction, page_locs([5], P), page_locs([2], P))
    assert_same_bytes(got, fixed, "host page out of range")
    assert bool((bits(fixed.host_big if direction == "d2h" else fixed.dev_bigs[0]) == POISON).any())


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("kind", ["kv_bf16", "indexer"])
def test_negative_locations_are_skipped_on_the_device_and_keep_the_pairing(monkeypatch, kind, direction):
    """Unchecked, the kernel computes owners with floor division like the CPU
    side: logical page -1 belongs to rank 1 of 2, takes the first host slot,
    and is skipped (physical page -1); a negative host location is skipped
    too. The other owned pages keep their host slots."""
    _unchecked(monkeypatch)
    placement = CpPlacement(P, 2, 1)
    pools = make_pools(kind, P, "page_first", placement, direction=direction, dev_pages=3, host_pages=4)
    got = pools.clone()
    device_locs = torch.cat([page_locs([-1], P), page_locs([1, 2, 3, 5], P)])  # owned: -1, 1, 3, 5
    host_locs = torch.cat([page_locs([0, 1], P), page_locs([-1], P), page_locs([3], P)])
    run_triton(got, direction, device_locs, host_locs, layer_id=1)
    want = pools.clone()
    run_triton(want, direction, page_locs([1, 5], P), page_locs([1, 3], P), layer_id=1)
    assert_same_bytes(got, want, "negative pages")
    dst_changed = changed_bytes(got.host_big, pools.host_big) if direction == "d2h" else changed_bytes(
        got.dev_bigs[1], pools.dev_bigs[1])
    assert dst_changed > 0
