"""What the library adds to a 0.5.23 stack is one record, handed over
explicitly: no module of the adapter finds a library attribute by name on an
SGLang object, and every method it replaces on an SGLang instance is named
in the docs.

Read from the source (``ast``), so a new ``getattr(x, "cp_...")`` or a new
replaced method fails here before any stack is built."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "sglang_cp_hicache" / "sglang_0523"
DOC = ROOT / "docs" / "sglang-0.5.23.md"

#: The builtins that find or set an attribute by a name in a string.
_BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def library_attributes_by_name(source: str) -> list[tuple[int, str]]:
    """(line, name) of every ``getattr``-like call whose name is a string
    literal starting with ``cp_`` (the library's attribute prefix)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BY_NAME:
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if isinstance(name, str) and name.startswith("cp_"):
                    found.append((node.lineno, name))
    return found


def test_the_check_sees_a_library_attribute_found_by_name():
    source = 'x = getattr(ctrl, "cp_l3", None)\nsetattr(ctrl, "cp_host_room", r)\ny = getattr(a, "dp_size", 1)\n'
    assert library_attributes_by_name(source) == [(1, "cp_l3"), (2, "cp_host_room")]


@pytest.mark.parametrize("path", sorted(ADAPTER.glob("*.py")), ids=lambda p: p.name)
def test_no_adapter_module_finds_a_library_attribute_by_name(path):
    assert library_attributes_by_name(path.read_text()) == [], path.name


def _assigned_attributes(path: Path, method: str) -> set[str]:
    """Attribute names assigned in ``method`` of ``path``'s classes (``x.name = ...``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == method:
            for stmt in ast.walk(node):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
                names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
    return names


def test_the_controller_declares_one_library_attribute():
    """The record is the only ``cp_`` attribute the library's controller holds."""
    declared = {n for n in _assigned_attributes(ADAPTER / "controller.py", "__init__") if n.startswith("cp_")}
    assert declared == {"cp_stack"}


def test_the_record_holds_what_the_strategy_added():
    from sglang_cp_hicache.sglang_0523.stack import CpStack0523

    fields = [f.name for f in dataclasses.fields(CpStack0523)]
    assert fields == ["placement", "host_room", "device_frees", "run_frees", "warmup", "l3", "metrics"]


def test_every_method_replaced_on_an_instance_is_named_in_the_docs():
    from sglang_cp_hicache.sglang_0523.l3_cache import L3Driver

    replaced = (
        _assigned_attributes(ADAPTER / "host_room.py", "install")
        | _assigned_attributes(ADAPTER / "device_free.py", "install")
        | _assigned_attributes(ADAPTER / "request_free.py", "install")
        | _assigned_attributes(ADAPTER / "library_metrics.py", "install")  # check_hicache_events, as L3's
        | set(L3Driver._REPLACED)
        | {"apply_runtime_config"}  # l3_metrics.install_metrics, with --enable-metrics
    )
    assert len(replaced) == 19, sorted(replaced)
    doc = DOC.read_text()
    stack_doc = (ADAPTER / "stack.py").read_text()
    for name in sorted(replaced):
        assert f"``{name}``" in stack_doc, name
        assert f"`{name}`" in doc, name
