"""The l3 package is core: torch, the standard library, its declared
dependencies and core modules only (never sglang, triton, an adapter, the
harness or the simulator)."""

import ast
import pathlib
import subprocess
import sys

L3 = pathlib.Path(__file__).resolve().parents[2] / "sglang_cp_hicache" / "l3"
CORE = {"sglang_cp_hicache.placement", "sglang_cp_hicache.validation", "sglang_cp_hicache.settings",
        "sglang_cp_hicache.sizes"}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}:{node.lineno} relative import"
            out.append((node.lineno, node.module))
    return out


#: Third-party modules l3 may import lazily, inside the one function that
#: needs them: a YAML ``@file`` extra config (as SGLang reads it); Prometheus
#: counters (SGLang's metrics library, only with --enable-metrics).
LAZY_OPTIONAL = {"yaml", "prometheus_client"}
#: Declared dependencies besides torch (pyproject.toml): the envelope's
#: checksum and keyed MAC; numpy for the host copy (one thread per copy, the GIL released).
DEPENDENCIES = {"xxhash", "numpy", "blake3"}


def test_the_dependencies_l3_imports_are_declared():
    text = (L3.parents[1] / "pyproject.toml").read_text()
    assert all(f'"{name}' in text for name in DEPENDENCIES)


def _allowed(module: str) -> bool:
    top = module.split(".")[0]
    if top in LAZY_OPTIONAL or top in DEPENDENCIES:
        return True
    if top == "sglang_cp_hicache":
        return module in CORE or module.startswith("sglang_cp_hicache.l3")
    return top == "torch" or top in sys.stdlib_module_names


def test_l3_imports_only_torch_stdlib_and_core():
    files = sorted(L3.glob("*.py"))
    assert len(files) >= 7
    bad = [f"{p.name}:{line} imports {m}" for p in files for line, m in _imports(p) if not _allowed(m)]
    assert bad == []


def test_importing_l3_loads_no_sglang_triton_or_upper_room():
    code = ("import sys, sglang_cp_hicache.l3;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'triton')"
            " or m.startswith(('sglang_cp_hicache.sglang', 'sglang_cp_hicache.testing',"
            " 'sglang_cp_hicache.sim', 'sglang_cp_hicache.kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
