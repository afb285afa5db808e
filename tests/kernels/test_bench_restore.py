"""bench/bench_restore.py on CPU tensors (its --cpu mode, small sizes): the
rows it writes, that the restored and backed-up bytes are checked bit for
bit, and that a copy that goes wrong is reported. No GPU result here."""

from __future__ import annotations

import csv
import json
import pathlib

import pytest
import torch

from sglang_cp_hicache.kernels import transfer

from tests.helpers.bench_scripts import bench_module

SMALL = ["--cpu", "--tokens", "600", "--layers", "2", "--reps", "1"]  # 10 pages, the last one partly used


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_restore") as module:
        yield module


def _rows(out: pathlib.Path) -> dict:
    return json.loads((out / "restore_cpu.json").read_text())


def test_cpu_run_writes_one_checked_row_per_rank_and_op(tmp_path, bench, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layouts = "layer_first,page_first,page_first_direct"
    # Every configuration must run: the budget is only a hang guard here (a
    # shared machine and a parallel test run slow it down); the budget's own
    # rule is test_a_spent_time_budget_skips_configurations_and_fails.
    rc = bench.main([*SMALL, "--out", str(tmp_path), "--cp-sizes", "1,3", "--ranks", "all",
                     "--host-layouts", layouts, "--kv-dtypes", "fp8,bf16", "--git-sha", "abc123",
                     "--time-budget-s", "600"])
    assert rc == 0
    out = _rows(tmp_path)
    assert out["ok"] is True and out["failures"] == [] and out["skipped"] == []
    assert out["meta"]["device"] == "cpu" and out["meta"]["backend"] == "reference"
    assert out["meta"]["git_sha"] == "abc123"
    assert out["shape"] == {"tokens": 600, "num_layers": 2, "page_size": 64}
    rows = out["rows"]
    assert len(rows) == 2 * 3 * 2 * (1 + 3)  # kv dtypes x layouts x ops x ranks
    page_bytes = {"fp8": 64 * 656, "bf16": 64 * 1152}
    for r in rows:
        assert r["bit_exact"] is True and r["error"] is None
        assert r["num_pages"] == 10 and r["num_layers"] == 2 and r["indexer_page_bytes"] == 64 * 132
        assert r["kv_page_bytes"] == page_bytes[r["kv_dtype"]]
        assert r["bytes"] == r["owned_pages"] * 2 * (r["kv_page_bytes"] + r["indexer_page_bytes"])
        assert r["min_ms"] <= r["p50_ms"] <= r["max_ms"] and r["p50_ms"] > 0 and r["ceiling_gbps"] > 0
        # 4 significant digits each
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["p50_ms"] * 1e-3) / 1e9, rel=2e-3)
        assert r["pct_of_ceiling"] == pytest.approx(100 * r["gbps"] / r["ceiling_gbps"], rel=2e-3)
    # the real owner mix: at CP 3 the ranks own 4, 3 and 3 of the 10 pages
    owned = {r["rank"]: r["owned_pages"] for r in rows if r["cp_size"] == 3 and r["op"] == "restore"}
    assert owned == {0: 4, 1: 3, 2: 3}
    with open(tmp_path / "restore_cpu.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == bench.CSV_FIELDS and len(table) == len(rows)


def test_cpu_run_on_the_interpreter(tmp_path, bench, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc = bench.main([*SMALL, "--out", str(tmp_path), "--cp-sizes", "2", "--ranks", "1",
                     "--host-layouts", "page_first"])
    out = _rows(tmp_path)
    assert rc == 0 and out["meta"]["backend"] == "triton-interpret"
    assert [(r["op"], r["cp_size"], r["rank"], r["bit_exact"]) for r in out["rows"]] == [
        ("backup", 2, 1, True), ("restore", 2, 1, True)]


def _run_broken(bench, tmp_path, monkeypatch, name, broken) -> dict:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(transfer, name, broken)
    rc = bench.main([*SMALL, "--out", str(tmp_path), "--cp-sizes", "2", "--host-layouts", "layer_first"])
    out = _rows(tmp_path)
    assert rc == 1 and out["ok"] is False
    return {r["op"]: r["error"] for r in out["rows"]}


def test_a_restore_that_skips_a_layer_is_reported(tmp_path, bench, monkeypatch):
    real = transfer.load_indexer_one_layer

    def skip_layer_1(dev, host, hl, layer, *args):
        if layer != 1:
            real(dev, host, hl, layer, *args)

    errors = _run_broken(bench, tmp_path, monkeypatch, "load_indexer_one_layer", skip_layer_1)
    assert errors == {"backup": None,
                      "restore": "restore: indexer layer 1: restored pages differ from their source pages"}


def test_a_restore_that_writes_a_page_it_was_not_given_is_reported(tmp_path, bench, monkeypatch):
    real = transfer.load_kv_one_layer

    def stray(dev, host, hl, layer, dl, hlocs, placement):
        real(dev, host, hl, layer, dl, hlocs, placement)
        P, n = placement.page_size, placement.cp_size
        pages = dl.view(-1, P)[:, 0] // P
        restored = set((pages[pages % n == placement.cp_rank] // n).tolist())
        free = next(p for p in range(dev.shape[0] // P) if p not in restored)
        dev.view(torch.uint8)[free * P].fill_(0)  # one token row of a page this call was not given

    errors = _run_broken(bench, tmp_path, monkeypatch, "load_kv_one_layer", stray)
    assert errors["restore"] == "restore: kv layer 0: a page this rank did not restore was written"


def test_a_backup_that_writes_outside_its_host_slots_is_reported(tmp_path, bench, monkeypatch):
    real = transfer.backup_kv_all_layers
    written = []

    def stray(devs, host, hl, dl, hlocs, placement):
        real(devs, host, hl, dl, hlocs, placement)
        used = set((hlocs // placement.page_size).tolist())
        free = next(p for p in range(host.shape[1] // placement.page_size) if p not in used)
        host[0, free * placement.page_size].view(torch.uint8).fill_(0)
        written.append(free)

    errors = _run_broken(bench, tmp_path, monkeypatch, "backup_kv_all_layers", stray)
    assert written and errors["backup"] == "backup: kv: a host slot outside host_locs was written"


def test_a_spent_time_budget_skips_configurations_and_fails(tmp_path, bench, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench.main([*SMALL, "--out", str(tmp_path), "--time-budget-s", "0"]) == 1
    out = _rows(tmp_path)
    assert out["ok"] is False and out["rows"] == [] and out["skipped"] == ["fp8: time budget spent"]


def test_bad_arguments_are_refused_by_name(tmp_path, bench, capsys):
    for argv, name in ((["--kv-dtypes", "fp4"], "--kv-dtypes"), (["--host-layouts", "rows"], "--host-layouts"),
                       (["--cp-sizes", "0"], "--cp-sizes")):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--cpu", "--out", str(tmp_path), *argv])
        assert exc.value.code == 2 and name in capsys.readouterr().err
    assert not (tmp_path / "restore_cpu.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_mode_without_cuda_exits_2(tmp_path, bench, capsys):
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
