"""Each SGLang release gets its own torch extensions directory: 0.5.18 and
0.5.23 both JIT-build ``hicache_hash_cpp`` from different sources, and a
fresh-clone CI run had a 0.5.18 rank segfault in pybind11 while a 0.5.23
process rebuilt it in the shared directory (the fleet test, both releases
at once)."""

from __future__ import annotations

import importlib.metadata
import os
import sys

from sglang_cp_hicache.sim.extensions import isolate_torch_extensions

PY = f"py{sys.version_info.major}{sys.version_info.minor}"


def test_each_release_builds_in_its_own_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = isolate_torch_extensions("0.5.18")
    assert a == os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions" / f"sglang-0.5.18-{PY}")
    assert isolate_torch_extensions("0.5.18") == a  # idempotent: no nesting
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert isolate_torch_extensions("0.5.23") == str(tmp_path / "mine" / f"sglang-0.5.23-{PY}")


def test_the_installed_release_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert isolate_torch_extensions() == str(tmp_path / f"sglang-{importlib.metadata.version('sglang')}-{PY}")


def test_the_test_session_runs_isolated():
    assert os.path.basename(os.environ["TORCH_EXTENSIONS_DIR"]).startswith(
        f"sglang-{importlib.metadata.version('sglang')}-")
