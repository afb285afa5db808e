"""Load a benchmark script (``bench/<name>.py``) as a module, the way
``python bench/<name>.py`` would find its imports: with ``bench/`` on
``sys.path`` (its shared helpers, e.g. ``bench_paths``)."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Iterator

__all__ = ["BENCH", "bench_module"]

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def bench_module(name: str, module_name: str | None = None) -> Iterator[ModuleType]:
    """``bench/<name>.py`` loaded and registered in ``sys.modules`` as
    ``module_name`` (``name`` by default; dataclasses look their module up)
    while the block runs; unregistered afterwards."""
    module_name = module_name or name
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(module_name, None)
