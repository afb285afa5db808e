"""sglang_cp_hicache.transfer: backend choice (read at call time), identical
results across backends, warm-up entry point, and a backup -> load round trip."""

from __future__ import annotations

import inspect
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kernels_conftest import POISON, bits, make_pools, page_locs
from sglang_cp_hicache import transfer
from sglang_cp_hicache.kernels import cp_page_copy, reference
from sglang_cp_hicache.layout import CpSharedKVLayout

ROOT = pathlib.Path(__file__).resolve().parents[1]
FUNCS = ["backup_kv_all_layers", "load_kv_one_layer", "backup_indexer_all_layers", "load_indexer_one_layer"]


@pytest.mark.parametrize("value,expected", [(None, "reference"), ("0", "reference"), ("1", "triton-interpret"),
                                            ("true", "triton-interpret")])
def test_cpu_backend_follows_triton_interpret_at_call_time(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert transfer.select_backend("cpu") == expected
    assert transfer.select_backend(torch.device("cpu")) == expected


@pytest.mark.parametrize("value", [None, "1"])
def test_cuda_always_gets_the_compiled_kernels(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert transfer.select_backend("cuda") == "triton"
    assert transfer.select_backend("cuda:1") == "triton"
    assert transfer.select_backend("meta") == "reference"


@pytest.mark.parametrize("name", FUNCS)
def test_signatures_match_the_reference(name):
    ours = inspect.signature(getattr(transfer, name))
    ref = inspect.signature(getattr(reference, f"{name}_reference"))
    assert list(ours.parameters) == list(ref.parameters)
    kernel = inspect.signature(getattr(cp_page_copy, name))
    assert list(kernel.parameters)[: len(ref.parameters)] == list(ref.parameters)


def _spy(monkeypatch, calls):
    for name in FUNCS:
        for module, tag, attr in ((cp_page_copy, "triton", name), (reference, "reference", f"{name}_reference")):
            real = getattr(module, attr)

            def spy(*a, _real=real, _tag=tag, **k):
                calls.append(_tag)
                return _real(*a, **k)

            monkeypatch.setattr(module, attr, spy)


def _run(pools, direction, dl, hl, layer_id=1):
    lay, h = pools.layout, pools.host_layout
    if pools.kv:
        if direction == "d2h":
            transfer.backup_kv_all_layers(pools.devs, pools.host, h, dl, hl, lay)
        else:
            transfer.load_kv_one_layer(pools.devs[layer_id], pools.host, h, layer_id, dl, hl, lay)
    elif direction == "d2h":
        transfer.backup_indexer_all_layers(pools.devs, pools.host, h, dl, hl, lay)
    else:
        transfer.load_indexer_one_layer(pools.devs[layer_id], pools.host, h, layer_id, dl, hl, lay)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("kind", ["kv_bf16", "indexer"])
def test_both_cpu_backends_give_identical_bytes(monkeypatch, kind, direction):
    calls: list[str] = []
    _spy(monkeypatch, calls)
    layout = CpSharedKVLayout(16, 2, 1)
    pools = make_pools(kind, 16, "page_first_direct", layout, direction=direction)
    dl, hl = page_locs([3, 4, 9, 0], 16), page_locs([5, 1], 16)
    results = {}
    for value, tag in ((None, "reference"), ("1", "triton")):
        if value is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", value)
        calls.clear()
        results[tag] = pools.clone()
        _run(results[tag], direction, dl, hl)
        assert calls == [tag]
    for x, y in zip(results["triton"].dev_bigs, results["reference"].dev_bigs):
        assert torch.equal(bits(x), bits(y))
    assert torch.equal(bits(results["triton"].host_big), bits(results["reference"].host_big))


@pytest.mark.parametrize("interpret", [None, "1"])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first", "page_first_direct"])
def test_backup_then_load_restores_every_owned_byte(monkeypatch, host_layout, interpret):
    """Invariant 9: every byte restored equals the byte backed up (KV and
    indexer), restored into other physical pages owned by the same rank."""
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    P, L = 64, 2
    layout = CpSharedKVLayout(P, 3, 2)
    for kind in ("kv_fp8", "indexer"):
        src = make_pools(kind, P, host_layout, layout, num_layers=L, dev_pages=4, host_pages=4,
                         direction="d2h", seed=11)
        backed_up = [2, 5, 8, 11, 1]  # rank 2 owns 2, 5, 8, 11 (physical 0..3)
        host_pages = [3, 0, 2, 1]
        _run(src, "d2h", page_locs(backed_up, P), page_locs(host_pages, P))
        dst = src.clone()
        for b in dst.dev_bigs:
            b.view(torch.uint8).fill_(POISON)
        restored = [11, 0, 8, 5, 2]  # new logical pages, same owner; reversed order
        reload_hosts = [1, 2, 0, 3]  # host page of each restored page, in owned order
        for layer in range(L):
            _run(dst, "h2d", page_locs(restored, P), page_locs(reload_hosts, P), layer_id=layer)
        # logical page restored[k'] received host page reload_hosts[k'], which
        # holds the page backed up from backed_up[host_pages.index(h)]
        owned_restored = [p for p in restored if p % 3 == 2]
        for layer in range(L):
            for new_page, h in zip(owned_restored, reload_hosts):
                old_page = [p for p in backed_up if p % 3 == 2][host_pages.index(h)]
                new_phys, old_phys = new_page // 3, old_page // 3
                if src.kv:
                    got = dst.devs[layer][new_phys * P : (new_phys + 1) * P]
                    want = src.devs[layer][old_phys * P : (old_phys + 1) * P]
                else:
                    got, want = dst.devs[layer][new_phys], src.devs[layer][old_phys]
                assert torch.equal(bits(got), bits(want)), (kind, layer, new_page)


def test_warmup_is_a_no_op_without_cuda():
    assert transfer.warmup is cp_page_copy.warmup
    cfg = dict(page_size=64, host_layout="page_first", num_layers=61, kv_dim=576, kv_dtype=torch.bfloat16,
               indexer_page_bytes=64 * 132)
    assert transfer.warmup(**cfg, device="cpu") == 0
    if not torch.cuda.is_available():
        assert transfer.warmup(**cfg) == 0


@pytest.mark.parametrize(
    "over,name",
    [(dict(host_layout="pages"), "host_layout"), (dict(page_size=0), "page_size"), (dict(num_layers=0), "num_layers"),
     (dict(kv_dim=None, indexer_page_bytes=None), "kv_dim"), (dict(block_bytes=3), "block_bytes")],
)
def test_warmup_validates_the_configuration(over, name):
    cfg = dict(page_size=64, host_layout="page_first", num_layers=2, kv_dim=576, kv_dtype=torch.bfloat16,
               indexer_page_bytes=8448, device="cpu")
    cfg.update(over)
    with pytest.raises(ValueError, match=name):
        transfer.warmup(**cfg)


def test_malformed_buffers_get_the_reference_error():
    layout = CpSharedKVLayout(4, 1, 0)
    with pytest.raises(ValueError, match="^device_kv must hold at least one layer"):
        transfer.backup_kv_all_layers([], torch.zeros(1, 4, 1, 8), "layer_first",
                                      page_locs([0], 4), page_locs([0], 4), layout)


def test_triton_interpret_set_before_import_uses_the_module_kernel():
    """The classic way: TRITON_INTERPRET=1 exported before python starts."""
    code = """
import torch
from sglang_cp_hicache import transfer
from sglang_cp_hicache.kernels import cp_page_copy, reference
from sglang_cp_hicache.layout import CpSharedKVLayout
assert cp_page_copy._is_interpreted(cp_page_copy._copy_pages_kernel)
assert transfer.select_backend("cpu") == "triton-interpret"
lay = CpSharedKVLayout(16, 2, 0)
dev = [torch.randint(0, 256, (64, 1, 656), dtype=torch.uint8) for _ in range(3)]
locs = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in (0, 1, 2, 6)])
hl = torch.arange(32, 80)
a = torch.full((6 * 16, 3, 1, 656), 0xA5, dtype=torch.uint8); b = a.clone()
transfer.backup_kv_all_layers(dev, a, "page_first", locs, hl, lay)
reference.backup_kv_all_layers_reference(dev, b, "page_first", locs, hl, lay)
assert torch.equal(a, b) and not torch.equal(a, torch.full_like(a, 0xA5))
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
