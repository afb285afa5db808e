"""Only sglang_cp_hicache/sglang/ may import sglang; core imports need only torch."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _sglang_imports(path: pathlib.Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "sglang" or a.name.startswith("sglang.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "sglang" or node.module.startswith("sglang."):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("sglang"):
                lines.append(node.lineno)
    return lines


def test_nothing_outside_the_adapter_imports_sglang():
    offenders = []
    for base in ("sglang_cp_hicache", "kernels", "bench"):
        for path in (ROOT / base).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("sglang_cp_hicache/sglang/"):
                continue
            offenders += [f"{rel}:{line}" for line in _sglang_imports(path)]
    assert offenders == []


def test_the_checker_catches_an_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom sglang.srt import x\nimport importlib\nimportlib.import_module('sglang.y')\n")
    assert _sglang_imports(bad) == [2, 4]


def test_core_import_does_not_load_sglang_or_triton():
    code = (
        "import sys, sglang_cp_hicache, sglang_cp_hicache.controller;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'triton')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
