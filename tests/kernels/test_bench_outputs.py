"""Benchmarks not told ``--out`` write a new path under build/bench-results,
never over the committed results in bench/results."""

import os
import pathlib

import pytest

from tests.helpers.bench_scripts import bench_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = ROOT / "build" / "bench-results"
SCRIPTS = ("bench_bookkeeping", "bench_transfer", "gpu_check_0523")


def _load(name):
    with bench_module(name, f"_bench_{name}") as module:
        return module


def _committed():
    return {p: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").rglob("*")}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_run_without_out_gets_a_fresh_path_outside_the_committed_results(name):
    module = _load(name)
    stem = f"probe-{name}-{os.getpid()}"  # parallel workers never share a probe file
    first = pathlib.Path(module.new_out_path(stem, ".csv"))
    assert first.parent == RUNS and first.name.startswith(f"{stem}_") and first.suffix == ".csv"
    assert not first.exists()
    RUNS.mkdir(parents=True, exist_ok=True)
    first.touch()
    try:
        second = pathlib.Path(module.new_out_path(stem, ".csv"))
        assert second != first and second.parent == RUNS and not second.exists()
    finally:
        first.unlink()


def test_bookkeeping_defaults_to_a_new_file():
    module = _load("bench_bookkeeping")
    args = module.parse([])
    assert pathlib.Path(args.out).parent == RUNS and not os.path.exists(args.out)
    assert module.parse(["--out", "bench/results/bookkeeping.csv"]).out == "bench/results/bookkeeping.csv"


def test_transfer_without_out_leaves_the_committed_results_alone(monkeypatch, tmp_path):
    module = _load("bench_transfer")
    before = _committed()
    chosen = []

    def fresh(stem, ext=""):
        chosen.append(stem)
        return str(tmp_path / f"{stem}_run")

    monkeypatch.setattr(module, "new_out_path", fresh)
    rc = module.main(["--cpu", "--quick", "--pages", "1", "--layers", "1", "--ceiling-mib", "1",
                      "--kinds", "indexer", "--cp-sizes", "1"])
    assert rc == 0 and chosen == ["transfer"]
    assert (tmp_path / "transfer_run" / "transfer_cpu_quick.csv").is_file()
    assert _committed() == before
