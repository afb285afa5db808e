"""``check`` on SGLang 0.5.23: the README's prefill launch line passes every
argument check; a value the library's stack or upstream's KV sharding
refuses fails naming the flag; the command end to end (one subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cp_hicache.preflight import launch
from sglang_cp_hicache.preflight.report import OK

from tests.helpers.readme_launch import check_kernel_pool_config, check_one_failure_naming, launch_line, with_flag

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "0.5.23"
README_LINE = launch_line("SGLang 0.5.23 prefill worker")


def _with(flag: str, value: str | None) -> list[str]:
    """The README line with ``flag`` set to ``value``."""
    return with_flag(README_LINE, flag, value)


def test_the_readme_launch_line_passes_every_argument_check(monkeypatch):
    monkeypatch.delenv("SGLANG_CP_HICACHE_COPY", raising=False)
    args, found = launch.launch_findings("0.5.23", README_LINE)
    assert args is not None and args.enable_kv_cache_sharding
    assert [f for f in found if f.level != OK] == []
    assert "--hicache-storage-backend" in {f.what for f in found}


@pytest.mark.parametrize("flag, value, words", [
    ("--hicache-storage-backend", "nixl", "--hicache-storage-backend 'nixl' is not supported"),
    ("--enable-kv-cache-sharding", None, "pass --enable-kv-cache-sharding"),
    ("--page-size", "32", "page_size=32"),
    ("--hicache-mem-layout", "page_first_direct", "hicache_mem_layout='page_first_direct'"),
    ("--radix-cache-backend", "cp-hicache", "drop --radix-cache-backend"),
    ("--kv-cache-dtype", "auto", "kv_cache_dtype='auto'"),
])
def test_a_value_the_stack_refuses_fails_naming_the_flag(flag, value, words):
    check_one_failure_naming(RELEASE, _with(flag, value), flag, words)


def test_a_storage_backend_on_upstream_s_copy_path_fails_naming_both(monkeypatch):
    monkeypatch.setenv("SGLANG_CP_HICACHE_COPY", "upstream")
    argv = _with("--hicache-storage-backend-extra-config", '{"file_storage_path": "/tmp/l3"}')
    _, found = launch.launch_findings("0.5.23", argv + ["--hicache-storage-backend", "file"])
    failed = [f for f in found if f.level == "FAIL"]
    assert len(failed) == 1 and failed[0].what == "--hicache-storage-backend", found
    assert "SGLANG_CP_HICACHE_COPY=upstream" in failed[0].text


def test_the_command_fails_a_storage_backend_it_cannot_serve_naming_the_flag():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SGLANG_PLUGINS", None)
    argv = _with("--hicache-storage-backend", "nixl")
    proc = subprocess.run([sys.executable, "-m", "sglang_cp_hicache", "check", "--", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "FAIL --hicache-storage-backend: --hicache-storage-backend 'nixl' is not supported" in proc.stdout
    assert "OK   SGLang: 0.5.23" in lines[0]
    assert any(x.startswith("FAIL device: no CUDA GPU visible") for x in lines) or "OK   device:" in proc.stdout


def test_the_kernel_pool_configuration_is_one_the_kernels_accept():
    check_kernel_pool_config(RELEASE, README_LINE)
