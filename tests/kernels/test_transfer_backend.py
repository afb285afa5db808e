"""sglang_cp_hicache.kernels.transfer: backend choice (read at call time),
identical results across backends, copy counters, warm-up, a backup -> load
round trip, and threaded ranks sharing Triton's interpreter."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from tests.helpers.kernel_pools import POISON, bits, make_pools, page_locs, run_transfer
from sglang_cp_hicache.kernels import _twin, compile, _triton_launch, reference, transfer
from sglang_cp_hicache.placement import CpPlacement

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    kernel = inspect.signature(getattr(_triton_launch, name))
    assert list(kernel.parameters)[: len(ref.parameters)] == list(ref.parameters)


def _spy(monkeypatch, calls):
    for module, tag in ((_triton_launch, "triton"), (reference, "reference")):
        real = module.run

        def spy(*a, _real=real, _tag=tag, **k):
            calls.append(_tag)
            return _real(*a, **k)

        monkeypatch.setattr(module, "run", spy)


def _run(pools, direction, dl, hl, layer_id=1):
    run_transfer(pools, direction, dl, hl, layer_id=layer_id)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("kind", ["kv_bf16", "indexer"])
def test_both_cpu_backends_give_identical_bytes(monkeypatch, kind, direction):
    calls: list[str] = []
    _spy(monkeypatch, calls)
    placement = CpPlacement(16, 2, 1)
    pools = make_pools(kind, 16, "page_first_direct", placement, direction=direction)
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
    placement = CpPlacement(P, 3, 2)
    for kind in ("kv_fp8", "indexer"):
        src = make_pools(kind, P, host_layout, placement, num_layers=L, dev_pages=4, host_pages=4,
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


WARM_CFG = dict(page_size=64, host_layout="page_first", num_layers=61, kv_dim=576, kv_dtype=torch.bfloat16,
                indexer_page_bytes=64 * 132)


def test_warmup_is_a_no_op_on_the_reference_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert transfer.warmup is compile.warmup
    for device in ("cpu", None) if not torch.cuda.is_available() else ("cpu",):
        report = transfer.warmup(**WARM_CFG, device=device)
        assert isinstance(report, transfer.WarmupReport)
        assert (report.backend, report.ops, report.compiled, report.cache_dir) == ("reference", [], 0, None)
        assert report.config == dict(page_size=64, host_layout="page_first", num_layers=61, kv_dim=576,
                                     kv_dtype="bfloat16", indexer_page_bytes=8448, device="cpu",
                                     block_bytes=_triton_launch.DEFAULT_BLOCK_BYTES)
        json.dumps(report.as_dict())


@pytest.mark.parametrize("kv,indexer,ops", [
    (True, True, ["kv_d2h", "kv_h2d", "indexer_d2h", "indexer_h2d"]),
    (True, False, ["kv_d2h", "kv_h2d"]),
    (False, True, ["indexer_d2h", "indexer_h2d"]),
])
def test_warmup_runs_each_op_once_under_the_interpreter(monkeypatch, kv, indexer, ops):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launched = []
    real = _triton_launch._launch

    def spy(plan, *a, **k):
        launched.append((plan.to_host, plan.dev_ptr_table, len(plan.dev_layers)))
        return real(plan, *a, **k)

    monkeypatch.setattr(_triton_launch, "_launch", spy)
    cfg = dict(WARM_CFG, device="cpu")
    if not kv:
        cfg.update(kv_dim=None, kv_dtype=None)
    if not indexer:
        cfg.update(indexer_page_bytes=None)
    report = transfer.warmup(**cfg)
    assert report.backend == "triton-interpret"
    assert report.ops == ops and report.compiled == len(ops)
    assert report.cache_dir is None and report.seconds >= 0
    assert report.config["num_layers"] == 61 and report.config["host_layout"] == "page_first"
    assert launched == [(op.endswith("d2h"), op.endswith("d2h"), 1) for op in ops]
    assert _twin.is_interpreted(_twin.kernel_for(True))
    json.dumps(report.as_dict())


@pytest.mark.parametrize(
    "over,name",
    [(dict(host_layout="pages"), "host_layout"), (dict(page_size=0), "page_size"), (dict(num_layers=0), "num_layers"),
     (dict(kv_dim=None, indexer_page_bytes=None), "kv_dim"), (dict(block_bytes=3), "block_bytes"),
     (dict(kv_dtype=None), "kv_dtype"), (dict(kv_dim=True), "kv_dim")],
)
def test_warmup_validates_the_configuration(over, name):
    cfg = dict(page_size=64, host_layout="page_first", num_layers=2, kv_dim=576, kv_dtype=torch.bfloat16,
               indexer_page_bytes=8448, device="cpu")
    cfg.update(over)
    with pytest.raises(ValueError, match=name):
        transfer.warmup(**cfg)


def test_malformed_buffers_get_the_reference_error():
    placement = CpPlacement(4, 1, 0)
    with pytest.raises(ValueError, match="^device_kv must hold at least one layer"):
        transfer.backup_kv_all_layers([], torch.zeros(1, 4, 1, 8), "layer_first",
                                      page_locs([0], 4), page_locs([0], 4), placement)


@pytest.mark.same_under_interpret  # a subprocess with TRITON_INTERPRET=1
def test_triton_interpret_set_before_import_uses_the_module_kernel():
    """The classic way: TRITON_INTERPRET=1 exported before python starts."""
    code = """
import os, torch
from sglang_cp_hicache.kernels import _kernel, _twin, transfer, reference
from sglang_cp_hicache.placement import CpPlacement
assert _kernel.INTERPRETED and _twin.kernel_for(True) is _kernel._copy_pages_kernel
assert transfer.select_backend("cpu") == "triton-interpret"
placement = CpPlacement(16, 2, 0)
dev = [torch.randint(0, 256, (64, 1, 656), dtype=torch.uint8) for _ in range(3)]
locs = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in (0, 1, 2, 6)])
hl = torch.arange(32, 80)
a = torch.full((6 * 16, 3, 1, 656), 0xA5, dtype=torch.uint8); b = a.clone()
transfer.backup_kv_all_layers(dev, a, "page_first", locs, hl, placement)
reference.backup_kv_all_layers_reference(dev, b, "page_first", locs, hl, placement)
assert torch.equal(a, b) and not torch.equal(a, torch.full_like(a, 0xA5))
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


@pytest.mark.same_under_interpret  # a subprocess without TRITON_INTERPRET
def test_the_twin_loader_never_touches_the_environment():
    """TRITON_INTERPRET unset at import: the interpreted twin is built without
    setting the variable, even for a moment (other threads read it)."""
    code = """
import os
seen = []
import sglang_cp_hicache.kernels._twin as twin
from sglang_cp_hicache.kernels import _kernel
assert not _kernel.INTERPRETED
real_setitem = type(os.environ).__setitem__
def watch(self, key, value):
    seen.append(key)
    return real_setitem(self, key, value)
type(os.environ).__setitem__ = watch
k = twin.kernel_for(True)
assert twin.is_interpreted(k) and twin.kernel_for(True) is k
assert twin.kernel_for(False) is _kernel._copy_pages_kernel
assert "TRITON_INTERPRET" not in os.environ and not seen, seen
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- copy counters
def test_copy_stats_count_calls_pages_backend_and_cp_size(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    transfer.reset_copy_stats()
    assert transfer.copy_stats() == transfer.CopyStats()
    assert transfer.copy_stats().backend is None and transfer.copy_stats().cp_size is None
    placement = CpPlacement(16, 2, 1)
    kv = make_pools("kv_bf16", 16, "layer_first", placement, direction="d2h")
    idx = make_pools("indexer", 16, "page_first", placement, direction="d2h")
    dl, hl = page_locs([3, 4, 9, 0], 16), page_locs([5, 1], 16)  # owned: 3, 9
    _run(kv, "d2h", dl, hl)
    _run(kv, "h2d", dl, hl)
    _run(kv, "h2d", dl, hl, layer_id=2)
    _run(idx, "d2h", dl, hl)
    _run(idx, "h2d", page_locs([0, 2], 16), torch.zeros(0, dtype=torch.int64))  # zero owned: still a call
    stats = transfer.copy_stats()
    assert stats == transfer.CopyStats(
        backend="reference", kv_backup_calls=1, kv_load_calls=2, indexer_backup_calls=1, indexer_load_calls=1,
        cp_size=2, pages_copied=2 * 4,
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _run(idx, "d2h", dl, hl)
    stats = transfer.copy_stats()
    assert (stats.backend, stats.indexer_backup_calls, stats.pages_copied) == ("triton-interpret", 2, 10)
    assert json.loads(json.dumps(stats.as_dict()))["indexer_backup_calls"] == 2
    transfer.reset_copy_stats()
    assert transfer.copy_stats() == transfer.CopyStats()


def test_refused_calls_are_not_counted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    transfer.reset_copy_stats()
    placement = CpPlacement(16, 2, 1)
    kv = make_pools("kv_bf16", 16, "layer_first", placement, direction="d2h")
    with pytest.raises(ValueError, match="^host_locs has 16 entries"):
        _run(kv, "d2h", page_locs([3, 4, 9, 0], 16), page_locs([5], 16))
    assert transfer.copy_stats() == transfer.CopyStats()


def test_copy_stats_are_thread_safe(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    transfer.reset_copy_stats()
    placement = CpPlacement(1, 1, 0)
    dev = [torch.zeros(4, 8, dtype=torch.uint8)]
    host = torch.zeros(1, 4, 8, dtype=torch.uint8)
    locs = torch.arange(2, dtype=torch.int64)
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        for _ in range(200):
            transfer.backup_indexer_all_layers(dev, host, "layer_first", locs, locs, placement)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = transfer.copy_stats()
    assert (stats.indexer_backup_calls, stats.pages_copied) == (800, 1600)
    transfer.reset_copy_stats()


# ----------------------------------------------------------------------------- threads + interpreter
def test_threaded_ranks_share_the_interpreter(monkeypatch):
    """Four CP ranks on four threads launch interpreted kernels at once (the
    interpreter patches triton.language process-wide while a kernel runs);
    every copy matches the reference bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    n, P = 4, 16
    errors: list[str] = []
    barrier = threading.Barrier(n)

    def rank(r: int) -> None:
        try:
            placement = CpPlacement(P, n, r)
            pools = make_pools("kv_fp8", P, "page_first", placement, direction="d2h", dev_pages=8, host_pages=8, seed=r)
            pages = list(range(4 * n))
            dl = page_locs(pages, P)
            hl = page_locs(range(sum(1 for p in pages if p % n == r)), P)
            barrier.wait()
            for _ in range(4):
                got, want = pools.clone(), pools.clone()
                _run(got, "d2h", dl, hl)
                reference.backup_kv_all_layers_reference(want.devs, want.host, want.host_layout, dl, hl, placement)
                if not torch.equal(bits(got.host_big), bits(want.host_big)):
                    errors.append(f"rank {r}: bytes differ")
                got, want = pools.clone(), pools.clone()
                _run(got, "h2d", dl, hl, layer_id=r % 3)
                reference.load_kv_one_layer_reference(want.devs[r % 3], want.host, want.host_layout, r % 3, dl, hl,
                                                      placement)
                if not all(torch.equal(bits(x), bits(y)) for x, y in zip(got.dev_bigs, want.dev_bigs)):
                    errors.append(f"rank {r}: load bytes differ")
        except Exception as exc:  # noqa: BLE001 -- reported below with the rank
            errors.append(f"rank {r}: {exc!r}"[:300])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
