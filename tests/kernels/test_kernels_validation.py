"""Launcher argument checks: each bad input raises TypeError/ValueError naming
the argument; empty batches return before any launch; debug-mode index checks;
out-of-range pages never write outside the buffers even without debug mode."""

from __future__ import annotations

import re

import pytest
import torch

from kernels_conftest import POISON, assert_same_bytes, bits, make_pools, page_locs, run_triton
from sglang_cp_hicache.kernels import DEBUG_ENV, cp_page_copy, reference
from sglang_cp_hicache.layout import CpSharedKVLayout

P = 4
LAYOUT = CpSharedKVLayout(P, 2, 0)
I64 = torch.int64


def kv_args(**over):
    """Valid backup_kv_all_layers arguments: 2 layers, 4 device pages, 3 host pages."""
    args = dict(
        device_kv=[torch.zeros(4 * P, 1, 8, dtype=torch.bfloat16) for _ in range(2)],
        host_kv=torch.zeros(2, 3 * P, 1, 8, dtype=torch.bfloat16),
        host_layout="layer_first",
        device_locs=page_locs([0, 1, 2], P),
        host_locs=page_locs([0, 2], P),
        layout=LAYOUT,
    )
    args.update(over)
    return args


def load_kv_args(**over):
    a = kv_args()
    args = dict(
        device_kv_layer=a["device_kv"][0], host_kv=a["host_kv"], host_layout="layer_first", layer_id=1,
        device_locs=a["device_locs"], host_locs=a["host_locs"], layout=LAYOUT,
    )
    args.update(over)
    return args


def index_args(**over):
    args = dict(
        device_index=[torch.zeros(4, 132 * P, dtype=torch.uint8) for _ in range(2)],
        host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.uint8),
        host_layout="page_first",
        device_locs=page_locs([0, 1, 2], P),
        host_locs=page_locs([0, 2], P),
        layout=LAYOUT,
    )
    args.update(over)
    return args


def load_index_args(**over):
    a = index_args()
    args = dict(
        device_index_layer=a["device_index"][1], host_index=a["host_index"], host_layout="page_first",
        layer_id=0, device_locs=a["device_locs"], host_locs=a["host_locs"], layout=LAYOUT,
    )
    args.update(over)
    return args


BACKUP_KV = (cp_page_copy.backup_kv_all_layers, reference.backup_kv_all_layers_reference)
LOAD_KV = (cp_page_copy.load_kv_one_layer, reference.load_kv_one_layer_reference)
BACKUP_IDX = (cp_page_copy.backup_indexer_all_layers, reference.backup_indexer_all_layers_reference)
LOAD_IDX = (cp_page_copy.load_indexer_one_layer, reference.load_indexer_one_layer_reference)

# (functions, args builder, overrides, exception, argument name in the message)
# Checked on the Triton launcher and, where the reference validates the same
# thing, on the reference too (both=True).
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
                                         torch.zeros(4 * P, 1, 16, dtype=torch.bfloat16)[..., ::2]]), ValueError, "device_kv[1]", False),
    (BACKUP_KV, kv_args, dict(device_kv=[torch.zeros(4 * P, 8, dtype=torch.bfloat16)]), ValueError, "device_kv[0]", True),
    (BACKUP_KV, kv_args, dict(host_kv=torch.zeros(2, 3 * P, 1, 16, dtype=torch.bfloat16)[..., ::2]), ValueError, "host_kv", False),
    (BACKUP_KV, kv_args, dict(host_layout="page_last"), ValueError, "host_layout", True),
    (BACKUP_KV, kv_args, dict(layout=(4, 2, 0)), TypeError, "layout", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2], P).to(torch.int32)), TypeError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(host_locs=page_locs([0, 2], P).float()), TypeError, "host_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2], P).view(3, P)), ValueError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=torch.arange(10, dtype=I64)), ValueError, "device_locs", True),
    (BACKUP_KV, kv_args, dict(host_locs=torch.arange(6, dtype=I64)), ValueError, "host_locs", True),
    (BACKUP_KV, kv_args, dict(host_locs=page_locs([0, 1, 2, 3], P)), ValueError, "host_locs", True),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2, 3], P)[::2]), ValueError, "device_locs", False),
    (BACKUP_KV, kv_args, dict(device_locs=page_locs([0, 1, 2], P).to("meta")), ValueError, "device_locs", False),
    (BACKUP_KV, kv_args, dict(device_kv=[torch.zeros(4 * P, 1, 8, dtype=torch.bfloat16, device="meta")]),
     ValueError, "device_kv[0]", False),
    (BACKUP_KV, kv_args, dict(num_ctas=0), ValueError, "num_ctas", False),
    (BACKUP_KV, kv_args, dict(block_bytes=100), ValueError, "block_bytes", False),
    (LOAD_KV, load_kv_args, dict(layer_id=2), ValueError, "layer_id", True),
    (LOAD_KV, load_kv_args, dict(layer_id=-1), ValueError, "layer_id", True),
    (LOAD_KV, load_kv_args, dict(layer_id=True), TypeError, "layer_id", True),
    (LOAD_KV, load_kv_args, dict(device_kv_layer=torch.zeros(4 * P, 1, 8)), TypeError, "device_kv_layer", True),
    (LOAD_KV, load_kv_args, dict(device_kv_layer=torch.zeros(4 * P, 1, 16, dtype=torch.bfloat16)[..., :8]), ValueError, "device_kv_layer", False),
    (LOAD_KV, load_kv_args, dict(host_locs=page_locs([0, 2], P).to("meta")), ValueError, "host_locs", False),
    (BACKUP_IDX, index_args, dict(host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.int8)), TypeError, "host_index", True),
    (BACKUP_IDX, index_args, dict(host_index=torch.zeros(3, 2, 132 * P, dtype=torch.uint8)), ValueError, "host_index", True),
    (BACKUP_IDX, index_args, dict(device_index=[torch.zeros(4, 132 * P, dtype=torch.int8)] * 2,
                                  host_index=torch.zeros(3, 2, 1, 132 * P, dtype=torch.int8)), TypeError, "device_index[0]", True),
    (BACKUP_IDX, index_args, dict(device_index=[torch.zeros(4, 1, 132 * P, dtype=torch.uint8)] * 2), ValueError, "device_index[0]", True),
    (LOAD_IDX, load_index_args, dict(layer_id=5), ValueError, "layer_id", True),
    (LOAD_IDX, load_index_args, dict(host_layout="layer_first"), ValueError, "host_index", True),
]


# Mechanism-specific checks (contiguity, device, grid) apply to the Triton
# launchers only; the reference handles such inputs.
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


def test_host_buffer_must_be_pinned_for_cuda_device_buffers():
    with pytest.raises(ValueError, match=r"^host_kv must be a pinned CPU tensor"):
        cp_page_copy._check_host_buffer("host_kv", torch.zeros(2, 4, 1, 8), torch.device("cuda", 0))


@pytest.mark.parametrize(
    "fn,build",
    [
        (cp_page_copy.backup_kv_all_layers, kv_args),
        (cp_page_copy.load_kv_one_layer, load_kv_args),
        (cp_page_copy.backup_indexer_all_layers, index_args),
        (cp_page_copy.load_indexer_one_layer, load_index_args),
    ],
)
@pytest.mark.parametrize("foreign_only", [False, True])
def test_empty_batches_return_before_launching(monkeypatch, fn, build, foreign_only):
    def no_launch(*a, **k):
        raise AssertionError("launched a kernel for an empty batch")

    monkeypatch.setattr(cp_page_copy, "_launch", no_launch)
    monkeypatch.setattr(cp_page_copy, "_kernel_for", no_launch)
    empty = torch.zeros(0, dtype=I64)
    device_locs = page_locs([1, 3], P) if foreign_only else empty  # rank 0 owns neither
    fn(**build(device_locs=device_locs, host_locs=empty))
    with pytest.raises(AssertionError, match="launched"):
        fn(**build())  # the same call with pages does launch


# ----------------------------------------------------------------------------- debug mode
DEBUG_BAD = [
    (dict(device_locs=page_locs([0, 1, 8], P)), "device_locs maps to physical page 4"),
    (dict(host_locs=page_locs([0, 3], P)), "host_locs reaches host page 3"),
    (dict(host_locs=page_locs([0, 2], P).flip(0).contiguous()), "host_locs must list whole pages"),
    (dict(host_locs=page_locs([0, 2], P) + 1), "host_locs must list whole pages"),
    (dict(device_locs=page_locs([0, 1, 2], P) - 2 * P), "device_locs holds negative"),
]


@pytest.mark.parametrize("over,message", DEBUG_BAD)
def test_debug_mode_checks_indices(monkeypatch, over, message):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError) as info:
        cp_page_copy.backup_kv_all_layers(**kv_args(**over))
    assert str(info.value).startswith(message), str(info.value)
    monkeypatch.setenv(DEBUG_ENV, "0")
    cp_page_copy.backup_kv_all_layers(**kv_args(**over))  # not checked: no error


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


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("kind", ["kv_fp8", "indexer"])
def test_out_of_range_pages_are_skipped_without_debug(monkeypatch, kind, direction):
    """Without debug mode, pages beyond either pool are not copied: no byte
    outside the buffers (or anywhere) changes, and in-range pages still copy."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    layout = CpSharedKVLayout(P, 2, 1)
    pools = make_pools(kind, P, "layer_first", layout, direction=direction, dev_pages=3, host_pages=3)
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
