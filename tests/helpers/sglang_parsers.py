"""SGLang's own value parsers, taken verbatim from the installed SGLang's
source files: importing ``sglang.srt`` costs 8-11 s on these CPU boxes, so
the functions are read out of their files with ``ast`` and run as written
(their module-level names supplied). None when SGLang is not installed."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import logging
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Optional

#: (file under sglang/srt, function): the parsers the library must agree with.
_SOURCES = {
    "human_readable_int": "utils/common.py",
    "_parse_size_to_bytes": "mem_cache/storage/file/lru_file_evictor.py",
    "_parse_global_segment_size": "mem_cache/storage/mooncake_store/mooncake_store.py",
}


def sglang_root() -> Optional[Path]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "srt"


@functools.lru_cache(maxsize=None)
def sglang_parsers() -> Optional[dict[str, Callable[..., Any]]]:
    """name -> SGLang's function, sharing one namespace (``_parse_size_to_bytes``
    calls ``human_readable_int``); None without SGLang."""
    root = sglang_root()
    if root is None:
        return None
    namespace: dict[str, Any] = {"argparse": argparse, "re": re, "Decimal": Decimal, "Any": Any,
                                 "logger": logging.getLogger("sglang.test_parsers")}
    for name, rel in _SOURCES.items():
        tree = ast.parse((root / rel).read_text())
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert len(found) == 1, f"SGLang's {rel} has no single {name}(): its parser moved; update this helper"
        exec(compile(ast.Module(body=found, type_ignores=[]), str(root / rel), "exec"), namespace)
    return {name: namespace[name] for name in _SOURCES}


def sglang_file_size(parsers: dict[str, Callable[..., Any]], value: object) -> Optional[int]:
    """What SGLang's file backend makes of ``value``: bytes, or None where it
    cannot read it (it then logs a warning and disables the bound)."""
    text = str(value).strip()
    if isinstance(value, str) and text and text != "0":
        try:  # _parse_size_to_bytes swallows the error: ask its parser directly
            parsers["human_readable_int"](text)
        except (argparse.ArgumentTypeError, ValueError):
            return None
    return parsers["_parse_size_to_bytes"](value)
