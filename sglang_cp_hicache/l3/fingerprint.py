"""A local checkpoint's bytes, fingerprinted in a bounded read at start-up.

File names, sizes and modification times alone do not name the weights: a
fine-tune keeps its base's exact shard sizes, and ``cp -p``, ``rsync -a`` or
``tar x`` keep mtimes. So each weight / index file (``*.safetensors``,
``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, ``*.json`` at the top of the
directory, where SGLang looks) enters the digest with:

* its name, size and modification time (a rewrite in place changes it);
* a ``.safetensors`` file's header whole: the 8-byte little-endian length and
  the JSON header it measures (every tensor's name, dtype, shape and offsets;
  at most 100 MB, safetensors' own bound);
* a ``.json`` file (config, ``model.safetensors.index.json``, tokenizer)
  whole up to :data:`JSON_WHOLE_LIMIT`;
* :data:`SAMPLES` blocks of :data:`BLOCK` bytes at evenly spaced offsets
  from the first byte to the last (the whole file when it is no larger).

So at most ``header + SAMPLES * BLOCK`` bytes (1 MiB plus the header) are
read from a weight file, whatever its size, :data:`READ_THREADS` files at a
time (a 701 GB checkpoint in well under a second: docs/l3.md).

The limit, stated plainly: two checkpoints whose files agree in every name,
size, mtime, header and sampled block but differ elsewhere get one
fingerprint -- bytes changed only between samples, with the size and mtime
restored, go unseen. Set ``SGLANG_CP_HICACHE_L3_MODEL_ID`` to name such
checkpoints apart.

The result is cached in this process's memory only, per file, keyed by the
file's real path, size, mtime, ctime, inode and device: the CPU ranks of one
process (and a re-opened L3) read the checkpoint once. Not on disk: a cache
file would be one more thing another account could plant or alter to make
two checkpoints one model, and one bounded read per process start costs
little.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BLOCK", "JSON_WHOLE_LIMIT", "READ_THREADS", "SAFETENSORS_HEADER_LIMIT", "SAMPLES", "WEIGHT_SUFFIXES",
    "FileFingerprint", "directory_fingerprint", "file_fingerprint", "forget_cached", "sample_offsets",
]

#: Files that make a checkpoint: weights and the index / config files.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")
#: Bytes in one sampled block.
BLOCK = 64 * 1024
#: Sampled blocks per file (the first and the last included).
SAMPLES = 16
#: A ``.json`` file up to this size is read whole (a larger one is sampled).
JSON_WHOLE_LIMIT = 16 * 1024 * 1024
#: safetensors refuses a longer header; a longer length is not a header.
SAFETENSORS_HEADER_LIMIT = 100_000_000
#: Files read at once (reads wait on storage, not on the CPU).
READ_THREADS = 8


@dataclass(frozen=True)
class FileFingerprint:
    """One file's digest and how many of its bytes were read for it."""

    name: str
    digest: str
    bytes_read: int


@dataclass(frozen=True)
class _StatKey:
    real_path: str
    size: int
    mtime_ns: int
    ctime_ns: int  # utime cannot set it back: a rewrite restoring the mtime still misses the cache
    inode: int
    device: int


_cache: dict[tuple[str, _StatKey], FileFingerprint] = {}
_cache_lock = threading.Lock()


def forget_cached() -> None:
    """Drop every cached fingerprint (the next call reads the files again)."""
    with _cache_lock:
        _cache.clear()


def sample_offsets(size: int) -> list[int]:
    """Where the sampled blocks of a ``size``-byte file start: evenly spaced
    from 0 to ``size - BLOCK``; one offset 0 when the file fits in the
    samples (it is then read whole)."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if size <= SAMPLES * BLOCK:
        return [0]
    last = size - BLOCK
    return [last * i // (SAMPLES - 1) for i in range(SAMPLES)]


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer only at end of file)."""
    parts = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        parts.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _read_file(path: str, name: str, st: os.stat_result) -> FileFingerprint:
    read = 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        digest = hashlib.sha256(f"{name}\0{size}\0{st.st_mtime_ns}\0".encode())
        if name.endswith(".safetensors") and size >= 8:
            head = _pread_all(fd, 8, 0)
            read += len(head)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if 0 < length <= min(SAFETENSORS_HEADER_LIMIT, size - 8):
                header = _pread_all(fd, length, 8)
                read += len(header)
                digest.update(b"header\0" + head + header)
            else:  # not a safetensors header: SGLang refuses it at load; the samples still name it
                digest.update(b"no-header\0")
        whole = size <= (JSON_WHOLE_LIMIT if name.endswith(".json") else SAMPLES * BLOCK)
        for offset in [0] if whole else sample_offsets(size):
            block = _pread_all(fd, size if whole else BLOCK, offset)
            read += len(block)
            digest.update(f"@{offset}:{len(block)}\0".encode() + block)
    finally:
        os.close(fd)
    return FileFingerprint(name, digest.hexdigest(), read)


def file_fingerprint(path: str | os.PathLike[str]) -> FileFingerprint:
    """The fingerprint of one file (see the module doc), cached by stat."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = _StatKey(real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    name = os.path.basename(path)  # the name SGLang globs (a link's, not its target's)
    with _cache_lock:
        cached = _cache.get((name, key))
    if cached is not None:
        return cached
    found = _read_file(real, name, st)
    with _cache_lock:
        _cache[(name, key)] = found
    return found


def _checkpoint_files(directory: Path) -> list[Path]:
    with os.scandir(directory) as entries:
        found = [Path(e.path) for e in entries if e.name.endswith(WEIGHT_SUFFIXES) and e.is_file()]
    return sorted(found, key=lambda p: p.name)


def directory_fingerprint(directory: str | os.PathLike[str]) -> str:
    """32 hex of SHA-256 over the fingerprints of ``directory``'s weight and
    index files, in name order."""
    files = _checkpoint_files(Path(directory))
    if len(files) <= 1:
        prints = [file_fingerprint(p) for p in files]
    else:
        with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(files)), thread_name_prefix="l3-fingerprint") as pool:
            prints = list(pool.map(file_fingerprint, files))
    text = "\n".join(f"{p.name}\t{p.digest}" for p in prints)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
