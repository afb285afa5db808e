"""The L3 model identity's content fingerprint on a DeepSeek-V3.2-sized
checkpoint: how long start-up spends reading it, and how many bytes.

Usage: python bench/bench_identity.py [--shards 163] [--shard-gb 4.3] [--rounds 3] [--dir DIR] [--out FILE.json]

Builds the layout of a 600 GB-class checkpoint in a temporary directory
(under ``--dir``): ``--shards`` safetensors shards of ``--shard-gb`` GB each,
sparse (``truncate``) behind a real safetensors header (DeepSeek-V3.2's
tensor names, FP8 weights and their scales, about 560 tensors a shard), a
``model.safetensors.index.json`` naming every tensor, ``config.json`` and a
tokenizer-sized ``tokenizer.json``. Then times
:func:`sglang_cp_hicache.l3.fingerprint.directory_fingerprint`:

* ``cold``: every file's pages dropped first (``fsync`` +
  ``posix_fadvise(DONTNEED)``, no root needed), so the headers and JSON come
  from disk -- the holes of a sparse file are zeros the kernel makes without
  a disk read, so a real checkpoint's sampled blocks add one storage read each
  (``reads`` below) on top;
* ``warm``: the page cache full, the in-process cache emptied;
* ``cached``: the in-process cache full (a second rank or L3 in one process).

Median of ``--rounds``. Without ``--out`` it writes a new file under
``build/bench-results/``. The layout takes a few MiB of disk, however large
its apparent size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from sglang_cp_hicache.l3 import fingerprint

from bench_paths import out_path

LAYERS = 61  # DeepSeek-V3.2: 61 layers, 256 routed experts, the first 3 layers dense
EXPERTS = 256
DENSE_LAYERS = 3


def _tensor_names() -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of DeepSeek-V3.2's main tensors (FP8 weights
    with their block scales)."""
    out: list[tuple[str, str, list[int]]] = [("model.embed_tokens.weight", "BF16", [129280, 7168])]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        for proj, shape in (("q_a_proj", [1536, 7168]), ("q_b_proj", [24576, 1536]), ("kv_a_proj_with_mqa", [576, 7168]),
                            ("kv_b_proj", [32768, 512]), ("o_proj", [7168, 16384])):
            out.append((f"{p}.self_attn.{proj}.weight", "F8_E4M3", shape))
            out.append((f"{p}.self_attn.{proj}.weight_scale_inv", "F32", [max(1, shape[0] // 128), shape[1] // 128]))
        out.append((f"{p}.self_attn.indexer.wq_b.weight", "F8_E4M3", [8192, 1536]))
        out.append((f"{p}.self_attn.indexer.wk.weight", "F8_E4M3", [128, 7168]))
        out.append((f"{p}.input_layernorm.weight", "BF16", [7168]))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", [7168]))
        experts = [f"{p}.mlp"] if layer < DENSE_LAYERS else [f"{p}.mlp.experts.{e}" for e in range(EXPERTS)]
        if layer >= DENSE_LAYERS:
            experts.append(f"{p}.mlp.shared_experts")
            out.append((f"{p}.mlp.gate.weight", "BF16", [EXPERTS, 7168]))
        for e in experts:
            for proj, shape in (("gate_proj", [2048, 7168]), ("up_proj", [2048, 7168]), ("down_proj", [7168, 2048])):
                out.append((f"{e}.{proj}.weight", "F8_E4M3", shape))
                out.append((f"{e}.{proj}.weight_scale_inv", "F32", [shape[0] // 128, shape[1] // 128]))
    out.append(("lm_head.weight", "BF16", [129280, 7168]))
    return out


def _header(tensors: list[tuple[str, str, list[int]]], size: int) -> bytes:
    """An 8-byte length and a safetensors JSON header spreading ``tensors``
    over a ``size``-byte file."""
    body = size - 8 - 256 * 1024  # room for the header itself
    step = body // max(1, len(tensors))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i, (name, dtype, shape) in enumerate(tensors):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [i * step, (i + 1) * step]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text


def build(root: Path, shards: int, shard_bytes: int) -> dict[str, Any]:
    """The checkpoint layout under ``root``; what it holds."""
    tensors = _tensor_names()
    per = -(-len(tensors) // shards)
    weight_map: dict[str, str] = {}
    header_bytes = []
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:06d}.safetensors"
        part = tensors[s * per:(s + 1) * per]
        head = _header(part, shard_bytes)
        header_bytes.append(len(head))
        with open(root / name, "wb") as f:
            f.write(head)
            f.truncate(shard_bytes)
        weight_map.update({t[0]: name for t in part})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": shards * shard_bytes}, "weight_map": weight_map}, indent=2))
    (root / "config.json").write_text(json.dumps({"architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers":
                                                  LAYERS, "n_routed_experts": EXPERTS, "hidden_size": 7168}))
    vocab = {f"tok{i}": i for i in range(129280)}
    merges = [f"t{i} o{i}" for i in range(127741)]
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": merges}}))
    files = sorted(os.listdir(root))
    return {
        "files": len(files), "shards": shards, "shard_bytes": shard_bytes, "tensors": len(tensors),
        "apparent_bytes": sum((root / f).stat().st_size for f in files),
        "allocated_bytes": sum((root / f).stat().st_blocks * 512 for f in files),
        "safetensors_header_bytes_median": int(statistics.median(header_bytes)),
        "json_bytes": sum((root / f).stat().st_size for f in files if f.endswith(".json")),
    }


def _drop_pages(root: Path) -> None:
    for name in os.listdir(root):
        fd = os.open(root / name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(root: Path, *, drop: bool, forget: bool) -> tuple[float, str]:
    if drop:
        _drop_pages(root)
    if forget:
        fingerprint.forget_cached()
    start = time.perf_counter()
    digest = fingerprint.directory_fingerprint(root)
    return time.perf_counter() - start, digest


def _reads(root: Path) -> dict[str, int]:
    """Bytes and read calls of one uncached fingerprint (counted at os.pread)."""
    counts = {"bytes": 0, "calls": 0}
    pread = os.pread

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = pread(fd, length, offset)
        counts["bytes"] += len(data)
        counts["calls"] += 1
        return data

    fingerprint.forget_cached()
    os.pread = counting  # type: ignore[assignment]
    try:
        fingerprint.directory_fingerprint(root)
    finally:
        os.pread = pread  # type: ignore[assignment]
    return counts


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--shards", type=int, default=163)
    ap.add_argument("--shard-gb", type=float, default=4.3, help="GB (10^9 bytes) per shard, sparse")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the temporary layout goes (default: the temp dir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in ("shards", "rounds"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.shard_gb <= 0:
        raise SystemExit(f"--shard-gb must be > 0, got {a.shard_gb}")
    root = Path(tempfile.mkdtemp(prefix="bench-identity-", dir=a.dir))
    try:
        layout = build(root, a.shards, int(a.shard_gb * 1e9))
        reads = _reads(root)
        cold, warm, cached, digests = [], [], [], set()
        for _ in range(a.rounds):
            for runs, drop, forget in ((cold, True, True), (warm, False, True), (cached, False, False)):
                seconds, digest = _timed(root, drop=drop, forget=forget)
                runs.append(seconds)
                digests.add(digest)
        if len(digests) != 1:
            raise SystemExit(f"the fingerprint changed between runs: {sorted(digests)}")
        fs = os.statvfs(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    shard_reads = 2 + fingerprint.SAMPLES  # length, header, samples
    result = {
        "command": "python bench/bench_identity.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("shards", a.shards), ("shard_gb", a.shard_gb),
                                                        ("rounds", a.rounds))),
        "layout": layout,
        "block_bytes": fingerprint.BLOCK, "samples_per_file": fingerprint.SAMPLES,
        "read_threads": fingerprint.READ_THREADS,
        "bytes_read": reads["bytes"], "read_calls": reads["calls"],
        "bytes_read_per_shard_median": layout["safetensors_header_bytes_median"] + fingerprint.SAMPLES * fingerprint.BLOCK,
        "reads_per_shard": shard_reads,
        "cold_s": round(statistics.median(cold), 4), "warm_s": round(statistics.median(warm), 4),
        "cached_s": round(statistics.median(cached), 6),
        "cold_s_all": [round(x, 4) for x in cold], "warm_s_all": [round(x, 4) for x in warm],
        "note": "Sparse shards: a hole reads as zeros without a disk read, so a real checkpoint adds its "
                f"{a.shards * fingerprint.SAMPLES:,} sampled-block reads ({fingerprint.READ_THREADS} at a time) "
                "at the storage's latency to cold_s",
        "cpus": os.cpu_count(), "python": platform.python_version(), "fs_block_bytes": fs.f_bsize,
    }
    text = json.dumps(result, indent=1)
    path = out_path(a.out, "identity_fingerprint", ".json")
    Path(path).write_text(text + "\n")
    print(text)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
