"""bench/gpu_check.sh and bench/gpu_check.py, as far as a CPU can test them:
the shell script's stages and failure handling (--dry-run, --cpu, no CUDA),
and the round-trip check itself on CPU tensors -- including that it reports a
copy that goes wrong. No GPU result is produced or claimed here."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from sglang_cp_hicache.kernels import _triton_launch
from sglang_cp_hicache.placement import CpPlacement

from tests.helpers.bench_scripts import bench_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check():
    with bench_module("gpu_check") as module:
        yield module


def _run_script(*args, env_over=None, timeout=240, script=SCRIPT):
    # GPU_CHECK_INSTALL=overlay: the install stage never runs pip in the test environment
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_INSTALL": "overlay", **(env_over or {})}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.same_under_interpret  # the script runs without TRITON_INTERPRET (_run_script)
def test_script_parses_and_dry_run_lists_every_stage(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    out = tmp_path / "new" / "dir"
    proc = _run_script("--dry-run", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    for stage in ("install", "env", "checks", "restore", "bandwidth", "pytest"):
        assert f"{stage}: would run" in summary
    assert "checks --device cuda" in summary and "--gpu --quick" in summary
    assert "pip install --no-deps --no-build-isolation --no-index -e" in summary
    assert "bench/bench_restore.py --time-budget-s" in summary
    assert "pytest tests/kernels -k cuda" in summary
    stages = [line.split(":")[0] for line in summary.splitlines() if ": would run" in line]
    assert stages == ["install", "env", "checks", "restore", "bandwidth", "pytest"]
    assert _run_script("--bogus").returncode == 2


@pytest.mark.same_under_interpret  # the script runs without TRITON_INTERPRET (_run_script)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_mode_without_cuda_fails_fast_after_recording_the_environment(tmp_path):
    proc = _run_script(env_over={"OUT": str(tmp_path / "o")})
    assert proc.returncode == 1
    assert json.loads((tmp_path / "o" / "env.json").read_text())["cuda_available"] is False
    assert "no CUDA device" in (tmp_path / "o" / "summary.txt").read_text()


@pytest.mark.same_under_interpret  # the script runs without TRITON_INTERPRET (_run_script)
@pytest.mark.slow(30)
def test_cpu_mode_writes_each_stage_even_when_one_fails(tmp_path):
    """A python that fails the checks stage only: the stage is reported
    FAILED, the bandwidth stage still writes its CSV and plots, exit 1."""
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = checks ] && { echo "injected failure" >&2; exit 3; }; done\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    proc = _run_script("--cpu", str(out), env_over={"PYTHON": str(wrapper)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "checks: FAILED (exit 3)" in summary
    assert "bandwidth: OK" in summary and "env: OK" in summary and "restore: OK" in summary
    assert "install: OK" in summary and f"already installed from {ROOT}" in summary
    restore = json.loads((out / "restore" / "restore_cpu.json").read_text())
    assert restore["ok"] is True and restore["meta"]["device"] == "cpu"
    assert {(r["op"], r["cp_size"]) for r in restore["rows"]} == {
        (op, n) for op in ("backup", "restore") for n in (1, 2, 8)}
    assert "injected failure" in (out / "checks.log").read_text()
    csv_text = (out / "bandwidth" / "transfer_cpu_quick.csv").read_text()
    assert "pct_of_ceiling" in csv_text.splitlines()[0] and len(csv_text.splitlines()) > 1
    for direction in ("d2h", "h2d"):
        assert (out / "bandwidth" / f"transfer_cpu_quick_{direction}.png").read_bytes()[:4] == b"\x89PNG"
    assert summary.rstrip().endswith("FAIL")


@pytest.mark.same_under_interpret  # the script runs without TRITON_INTERPRET (_run_script)
def test_install_stage_makes_another_checkout_importable_through_an_overlay(tmp_path):
    """A copy of the checkout run while the environment has the package from
    this one: that install is left alone (no pip), and a PYTHONPATH overlay
    makes the copy -- kernels/ mapped as sglang_cp_hicache.kernels -- import."""
    copy = tmp_path / "checkout"
    for part in ("sglang_cp_hicache", "kernels", "bench"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    out = tmp_path / "out"
    # a 4 s budget: the install runs, every later stage is skipped
    proc = _run_script("--cpu", str(out), script=copy / "bench" / "gpu_check.sh",
                       env_over={"GPU_CHECK_BUDGET_S": "4"})
    summary = (out / "summary.txt").read_text()
    assert "install: OK" in summary and "through a PYTHONPATH overlay" in summary, proc.stdout + proc.stderr
    assert "env: SKIPPED (time budget spent)" in summary and proc.returncode == 1
    log = (out / "install.log").read_text()
    assert f"imports from {ROOT.resolve()}, not from {copy.resolve()}: left installed" in log
    code = ("import os, sglang_cp_hicache as p, sglang_cp_hicache.kernels.transfer as t; "
            "print(os.path.realpath(p.__file__)); print(os.path.realpath(t.__file__))")
    env = {**os.environ, "PYTHONPATH": str(out / "pythonpath")}
    env.pop("TRITON_INTERPRET", None)  # like the script: the same run under either part of make test
    got = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert got.stdout.split() == [str(copy.resolve() / "sglang_cp_hicache" / "__init__.py"),
                                  str(copy.resolve() / "kernels" / "transfer.py")], got.stderr


@pytest.mark.parametrize("kind", ["kv_fp8", "indexer"])
def test_round_trip_check_passes_on_the_interpreter_and_catches_a_bad_copy(monkeypatch, gpu_check, kind):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = gpu_check.CPU_GEOMETRY
    cpu = torch.device("cpu")
    host = gpu_check.HostBuffer(gpu_check.host_shape(kind, "page_first", g), gpu_check.KINDS[kind][1], "plain")
    for n, r in ((1, 0), (8, 5)):
        placement = CpPlacement(g.page_size, n, r)
        assert gpu_check.roundtrip(kind, "page_first", placement, host, g, cpu, seed=n) is None
    # a load that skips the last layer, or a backup that loses one host page, must be reported
    real_run = _triton_launch.run

    def skip_last_layer(copy, **kw):
        if copy.to_host or copy.layer_id < g.num_layers - 1:
            real_run(copy, **kw)

    def lose_a_page(copy, **kw):
        real_run(copy, **kw)
        if copy.to_host:
            host_t = gpu_check.bits(copy.pool.host_buffer)
            host_t.view(-1)[: host_t.numel() // g.host_pages].fill_(0)

    placement = CpPlacement(g.page_size, 2, 1)
    with monkeypatch.context() as m:
        m.setattr(_triton_launch, "run", skip_last_layer)
        err = gpu_check.roundtrip(kind, "page_first", placement, host, g, cpu, seed=3)
    assert err == f"load: device layer {g.num_layers - 1} differs from the reference", err
    with monkeypatch.context() as m:
        m.setattr(_triton_launch, "run", lose_a_page)
        err = gpu_check.roundtrip(kind, "page_first", placement, host, g, cpu, seed=3)
    assert err is not None and err.startswith("backup: host bytes differ"), err


def test_checks_command_on_cpu_records_results(tmp_path, gpu_check, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = gpu_check.main(["checks", "--device", "cpu", "--out", str(tmp_path), "--cp-sizes", "2",
                         "--kinds", "kv_bf16", "--host-layouts", "page_first_direct"])
    assert rc == 0
    out = json.loads((tmp_path / "checks.json").read_text())
    assert out["device"] == "cpu" and out["backend"] == "reference" and out["ok"] is True
    assert set(out["roundtrip"]) == {"plain/kv_bf16/page_first_direct/cp2/rank0",
                                     "plain/kv_bf16/page_first_direct/cp2/rank1"}
    assert "sync_free" not in out  # a CPU run claims nothing about syncs
    assert out["copy_stats"]["kv_backup_calls"] == 2
