"""Rooms by audience, every import pointing down:

    sim  ->  testing  ->  sglang_0518, sglang_0523  ->  kernels, policy_0518, policy_0523, l3_backends  ->  core

* core (``sglang_cp_hicache/*.py``) imports nothing of the package above it,
  and never sglang or triton at import; ``policy_0518`` (torch only) imports
  only core;
* kernels import only core (never sglang);
* ``l3_backends`` (page stores on third-party systems) imports only core,
  never sglang; core never imports it;
* each adapter imports only its own SGLang release, never the harness, the
  simulator or the tests (production code);
* the harness never imports the simulator (the zygote that forks rank
  processes, the launcher-death guard and the content keys, which both use,
  live in the harness); nothing in the package imports tests;
* ``preflight`` (the ``check`` command) imports the adapters' checks, the
  kernels, ``l3_backends`` and, only on a machine without torchvision, the
  harness's import-only torchvision stand-in; only the CLI imports it.
"""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = "sglang_cp_hicache"

# room -> rooms of this package it may import (core is always allowed)
ALLOWED = {
    "core": set(),
    "policy_0518": set(),
    "policy_0523": set(),
    "kernels": set(),
    "l3_backends": set(),
    "sglang_0518": {"kernels", "policy_0518", "l3_backends"},
    "sglang_0523": {"kernels", "policy_0523", "l3_backends"},
    "testing": {"kernels", "policy_0518", "policy_0523", "l3_backends", "sglang_0518", "sglang_0523"},
    "sim": {"kernels", "policy_0518", "policy_0523", "l3_backends", "sglang_0518", "sglang_0523", "testing"},
    "preflight": {"kernels", "l3_backends", "sglang_0518", "sglang_0523", "testing"},
    "cli": {"sim", "preflight"},
}
PRODUCTION = {"core", "policy_0518", "policy_0523", "kernels", "l3_backends", "sglang_0518", "sglang_0523"}
TORCH_ONLY = ("core", "policy_0518", "policy_0523", "kernels", "l3_backends")


def room_of_file(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "kernels":
        return "kernels"
    if len(rel) == 2:
        return "cli" if rel[1] == "__main__.py" else "core"
    return rel[1] if rel[1] in ALLOWED else "core"


def room_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != PKG:
        return None
    if len(parts) == 1:
        return "core"
    return parts[1] if parts[1] in ALLOWED else "core"


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import, including import_module('...') calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module == PKG]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def package_files():
    yield from (ROOT / PKG).rglob("*.py")
    yield from (ROOT / "kernels").rglob("*.py")


def violations() -> list[str]:
    bad = []
    for path in package_files():
        room = room_of_file(path)
        rel = path.relative_to(ROOT).as_posix()
        for line, module in imports(path):
            top = module.split(".")[0]
            if top == "tests":
                bad.append(f"{rel}:{line} imports tests ({module})")
            elif top == "sglang" and room in TORCH_ONLY:
                bad.append(f"{rel}:{line} ({room}) imports sglang ({module})")
            target = room_of_module(module)
            if target is None or target == "core" or target == room:
                continue
            if target not in ALLOWED[room]:
                bad.append(f"{rel}:{line} ({room}) imports {target} ({module})")
    return bad


def test_every_import_points_down():
    assert violations() == []


def test_the_checker_catches_each_kind_of_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / PKG / "sglang_0518"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text(
        "from sglang_cp_hicache.testing import stack_0518\n"
        "import importlib\nimportlib.import_module('sglang_cp_hicache.sim.engine_0518')\n"
        "from tests.helpers import cp_cluster\n"
    )
    core = tmp_path / PKG / "placement.py"
    core.write_text("from sglang_cp_hicache.kernels import transfer\nimport sglang.srt\n"
                    "from sglang_cp_hicache.l3_backends import open_page_store\n")
    policy = tmp_path / PKG / "policy_0518"
    policy.mkdir()
    (policy / "plan.py").write_text("from sglang_cp_hicache.sglang_0518 import hiradix\nimport sglang\n")
    (tmp_path / "kernels").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = violations()
    assert any("sglang_0518/bad.py:1 (sglang_0518) imports testing" in v for v in found)
    assert any("sglang_0518/bad.py:3 (sglang_0518) imports sim" in v for v in found)
    assert any("sglang_0518/bad.py:4 imports tests" in v for v in found)
    assert any("placement.py:1 (core) imports kernels" in v for v in found)
    assert any("placement.py:2 (core) imports sglang" in v for v in found)
    assert any("placement.py:3 (core) imports l3_backends" in v for v in found)
    assert any("policy_0518/plan.py:1 (policy_0518) imports sglang_0518" in v for v in found)
    assert any("policy_0518/plan.py:2 (policy_0518) imports sglang" in v for v in found)


def test_core_import_does_not_load_sglang_or_triton():
    code = (
        "import sys, sglang_cp_hicache, sglang_cp_hicache.policy_0518.plan;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'triton')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
