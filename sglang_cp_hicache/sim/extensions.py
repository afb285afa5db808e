"""Each SGLang release builds torch's JIT extensions in its own directory.

SGLang 0.5.18 and 0.5.23 both build a native page-hash extension named
``hicache_hash_cpp`` (``mem_cache/cpp_utils/native_hash.py``), from
different sources (0.5.23's binding takes int64 token buffers, 0.5.18's
uint32), into torch's one extensions directory. Two releases at work on
one machine (a fleet of mixed releases, the two test suites at once)
rebuild it under each other, and a process can load the other release's
binding: a segfault in pybind11 was seen, wrong page hashes would be
quieter. Every process the simulator starts inherits a directory of its
release's own (and of its Python's: torch only adds that part itself when
the variable is unset).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Optional

__all__ = ["isolate_torch_extensions"]


def isolate_torch_extensions(sglang_version: Optional[str] = None) -> Optional[str]:
    """Point ``TORCH_EXTENSIONS_DIR`` at a subdirectory for the installed
    SGLang release (inside the one set, else torch's default); returns it,
    or None where SGLang is not installed. Idempotent."""
    if sglang_version is None:
        try:
            sglang_version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            return None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(cache, "torch_extensions")
    leaf = f"sglang-{sglang_version}-py{sys.version_info.major}{sys.version_info.minor}"
    if os.path.basename(os.path.normpath(base)) != leaf:
        base = os.path.join(base, leaf)
    os.environ["TORCH_EXTENSIONS_DIR"] = base
    return base
