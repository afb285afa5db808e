"""Which simulator run wrote the L3 objects a run restores from.

An L3 directory is shared between runs, CP sizes and SGLang releases. To
say how many restored pages came from objects another release wrote, each
``simulate --l3 DIR`` run leaves a manifest in ``DIR/.sim-writers/``: the
release and the objects it added. A later run (of either release) maps
each own page it restored to the manifest that names its object.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Iterable

from sglang_cp_hicache.l3.safe_files import create_exclusive, open_regular, open_subdir, write_all

__all__ = ["MANIFEST_DIR", "object_names", "restored_by_writer", "write_manifest", "writers_of"]

MANIFEST_DIR = ".sim-writers"
_SUFFIX = ".bin"


def object_names(directory: str) -> set[str]:
    """The page keys of every object in a file L3 directory."""
    names: set[str] = set()
    root = Path(directory)
    if not root.is_dir():
        return names
    for sub in os.scandir(root):
        if sub.is_dir(follow_symlinks=False) and not sub.name.startswith("."):
            names.update(e.name[: -len(_SUFFIX)] for e in os.scandir(sub.path) if e.name.endswith(_SUFFIX))
    return names


def writers_of(directory: str) -> dict[str, str]:
    """Page key -> the release whose run wrote its object (per the manifests)."""
    out: dict[str, str] = {}
    folder = Path(directory, MANIFEST_DIR)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            fd, _ = open_regular(os.fspath(path))  # no link followed, no wait on a FIFO
            with os.fdopen(fd, "rb") as f:
                manifest = json.loads(f.read())
            release, keys = manifest["release"], manifest["objects"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a torn or foreign file names no writer
        for key in keys:
            out.setdefault(key, release)
    return out


def write_manifest(directory: str, release: str, added: Iterable[str]) -> Path:
    """Record the objects this run added (atomically: a reader sees all or
    nothing), in a new file of a random name renamed into place, relative
    to the manifest folder opened without following a link: the L3
    directory is shared, and a link planted there is never written through."""
    name = f"{release}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.json"
    folder = open_subdir(os.fspath(directory), MANIFEST_DIR, create=True)
    try:
        fd, tmp = create_exclusive("", f".{name}.", ".tmp", dir_fd=folder)
        try:
            try:
                write_all(fd, json.dumps({"release": release, "objects": sorted(added)}).encode())
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            os.unlink(tmp, dir_fd=folder)
            raise
    finally:
        os.close(folder)
    return Path(directory, MANIFEST_DIR, name)


def restored_by_writer(restored_keys: Iterable[str], before: set[str], writers: dict[str, str]) -> dict[str, int]:
    """How many restored pages came from objects of each writer: a release
    (per its manifest), ``"this run"`` (written since the run started), or
    ``"unknown"`` (there before, written by no manifested run)."""
    counts: Counter[str] = Counter()
    for key in restored_keys:
        if key not in before:
            counts["this run"] += 1
        else:
            counts[writers.get(key, "unknown")] += 1
    return dict(sorted(counts.items()))
