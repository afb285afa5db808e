"""L3 file store: this library vs SGLang's ``HiCacheFile`` vs the raw floor.

Usage: python bench/bench_l3.py [--pages 64] [--threads 4] [--rounds 3] [--prefix-tokens 100000] [--out FILE.json]

Per DeepSeek-V3.2 page object -- KV (61 layers x 64 tokens x 656 B =
2,561,024 B) and DSA indexer (61 x 64 x 132 B = 515,328 B) -- write then
read ``--pages`` pages, page-cache hot (``--rounds`` rounds, the paths'
order rotated each round, the median reported) and once cold (dropped with
``posix_fadvise(DONTNEED)``), on four paths:

* ``library``: the library's path, as its L3 I/O threads run it
  (``--threads`` of them, each page its own job): write = read the object
  under the key if one is there, else one gather write of header + page
  (``pages.store_verified``); read = when the whole object is in the page
  cache, one non-blocking scatter read (``RWF_NOWAIT``) of header + page
  straight into the page's rows of a layer_first host pool, the header and
  the XXH3-64 checksum checked there, under the tier's publish lock; else one
  blocking read into the thread's staging buffer outside the lock, checked,
  then copied into the rows (``host_read.read_into_host``). Every byte
  verified before the page is published.
* ``library_keyed``: the same with a deployment secret: each object's tag
  is keyed BLAKE3 over header and payload (``l3.auth``), written and checked.
* ``hicachefile``: SGLang 0.5.18's own L3 path on its file backend, from and
  to the same host pool: write = each page's flat copy (``get_data_page(flat)``)
  then ``HiCacheFile.batch_set``; read = ``batch_get`` into a fresh flat page
  each (``get_dummy_flat_data_page``) then the copy into the host rows
  (``set_from_flat_data_page``); one thread, nothing verified.
* ``raw``: the floor: ``tofile`` / ``readinto`` a preallocated tensor, one
  thread, no host pool.

Then the time one CP rank takes to restore its pages of a ``--prefix-tokens``
DeepSeek-V3.2 prefix (KV and indexer objects, through ``HostL3Tier.read_page``
on the L3 threads, into host pools) at CP 1/2/4/8, hot and cold. And the
checksum candidates on this machine, and the MAC candidates on a page (its
61 layer runs streamed, and whole; one thread and ``--threads`` at once). Figures are GB/s of page bytes (1e9).

Without ``--out`` it writes a new file under ``build/bench-results/``;
``--out bench/results/l3.json`` replaces the committed figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from sglang_cp_hicache.l3.auth import ObjectSeal
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, byte_view
from sglang_cp_hicache.l3.host_copy import HostPageRuns
from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.host_read import read_into_host
from sglang_cp_hicache.l3.host_tier import HostL3Tier
from sglang_cp_hicache.l3.keys import L3Namespace, page_keys
from sglang_cp_hicache.l3.pages import store_verified
from sglang_cp_hicache.l3.store import FilePageStore
from sglang_cp_hicache.l3.workers import L3Job, L3Workers
from sglang_cp_hicache.placement import CpPlacement

from bench_paths import out_path

LAYERS, P, KV_ROW, INDEXER_ROW = 61, 64, 656, 132
KINDS = {"kv": KV_ROW, "indexer": INDEXER_ROW}


def _namespace(pool: str, row: int) -> L3Namespace:
    return L3Namespace(model_id="bench", kv_dtype="uint8", row_bytes=row, page_size=P, pool=pool,
                       layer_start=0, layer_end=LAYERS)


def _hashes(n: int, seed: int) -> list[str]:
    return [f"{seed:016x}{i:048x}" for i in range(n)]


def _drop_cache(directory: Path) -> None:
    """Page-cache cold: write back, then drop every file's cached pages."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _parallel(threads: int, jobs: list[Callable[[L3Job], Any]]) -> list[Any]:
    """Run ``jobs`` on ``threads`` L3 I/O threads (each its own L3 job, as
    the library's L3 does: ``fn(job)``, host writes through ``job.publish``)
    and wait."""
    workers = L3Workers("bench-l3", threads, spare=0)
    try:
        submitted = [workers.submit(lambda job, fn=fn: fn(job), timeout_s=3600) for fn in jobs]
        # Last job first: the waiting thread sleeps until the pool is (nearly)
        # through, as the scheduler thread does between two steps, instead
        # of waking once per page.
        workers.wait(submitted[::-1])
        return [j.result() for j in submitted]
    finally:
        workers.shutdown()


class _LayerFirstPool:
    """A layer_first host pool of ``pages`` pages (SGLang's MLA / indexer
    host layout: a page's rows of one layer contiguous, layers apart), with
    SGLang's page accessors (a page's index is its first token's row)."""

    def __init__(self, pages: int, row: int) -> None:
        self.buffer = torch.zeros((LAYERS, pages * P, row), dtype=torch.uint8)
        self.row = row

    def page(self, i: int) -> torch.Tensor:
        return self.buffer[:, i * P:(i + 1) * P]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.buffer[:, index:index + P]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, flat: torch.Tensor) -> None:
        """SGLang's copy (a torch assignment)."""
        self.buffer[:, index:index + P] = flat.view(LAYERS, P, self.row)

    def fill(self, i: int, flat: torch.Tensor) -> None:
        self.set_from_flat_data_page(i * P, flat)


class _RawPath:
    """The floor: ``tofile`` / ``readinto`` a preallocated tensor, one thread."""

    def __init__(self, data: list[torch.Tensor], ns: L3Namespace, row: int, threads: int) -> None:
        self.data, self.dest = data, torch.empty((len(data), ns.page_bytes), dtype=torch.uint8)

    def write(self, directory: Path) -> None:
        self.directory = directory
        for i, page in enumerate(self.data):
            page.numpy().tofile(directory / f"{i}.bin")

    def poison(self) -> None:
        self.dest.fill_(0xA5)

    def read(self, threads: int | None = None) -> None:
        for i in range(len(self.data)):
            with open(self.directory / f"{i}.bin", "rb", buffering=0) as f:
                f.readinto(memoryview(self.dest[i].numpy()))

    def check(self) -> bool:
        return all(torch.equal(self.dest[i], page) for i, page in enumerate(self.data))


class _HiCacheFilePath:
    """SGLang's HiCacheFile, from and to a host pool as SGLang's own L3 path does."""

    def __init__(self, data: list[torch.Tensor], ns: L3Namespace, row: int, threads: int) -> None:
        self.data, self.ns = data, ns
        self.keys = _hashes(len(data), 1)
        self.host = _LayerFirstPool(len(data), row)
        for i, page in enumerate(data):
            self.host.fill(i, page)

    def write(self, directory: Path) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                      is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                                      model_name="bench")
        self.hf = HiCacheFile(config, file_path=str(directory))
        flats = [self.host.page(i).reshape(-1).contiguous() for i in range(len(self.data))]
        assert self.hf.batch_set(self.keys, flats)

    def poison(self) -> None:
        self.host.buffer.fill_(0xA5)

    def read(self, threads: int | None = None) -> None:
        got = self.hf.batch_get(self.keys, [torch.empty(self.ns.page_bytes, dtype=torch.uint8) for _ in self.data])
        for i, flat in enumerate(got):
            self.host.fill(i, flat)

    def check(self) -> bool:
        return all(torch.equal(self.host.page(i).reshape(-1), page) for i, page in enumerate(self.data))


class _LibraryPath:
    """This library, through its L3 threads, every byte verified."""

    def __init__(self, data: list[torch.Tensor], ns: L3Namespace, row: int, threads: int) -> None:
        self.data, self.ns, self.threads = data, ns, threads
        self.keys = page_keys(_hashes(len(data), 2), ns)
        self.host = _LayerFirstPool(len(data), row)
        for i, page in enumerate(data):
            self.host.fill(i, page)
        self.rows = HostPageRuns(self.host, self.host.buffer)
        self.scratch = threading.local()

    def _buffers(self) -> tuple[memoryview, memoryview, torch.Tensor]:
        s = self.scratch
        if not hasattr(s, "page"):
            s.head, s.page = memoryview(bytearray(HEADER_BYTES)), torch.empty(self.ns.page_bytes, dtype=torch.uint8)
        return s.head, byte_view(s.page), s.page

    def write(self, directory: Path) -> None:
        self.store = FilePageStore(directory)
        self.caps = StoreCapabilities.of(self.store)

        def write_page(i: int) -> None:
            snapshot = self.host.page(i).reshape(-1).contiguous()  # what the writer copies out at the ack
            head, payload, _ = self._buffers()
            assert store_verified(self.caps, self.ns, self.keys[i], snapshot, (head, payload)).in_l3

        _parallel(self.threads, [lambda job, i=i: write_page(i) for i in range(len(self.data))])

    def poison(self) -> None:
        self.host.buffer.fill_(0xA5)

    def read(self, threads: int | None = None) -> None:
        def read_page(job: L3Job, i: int) -> None:  # what HostL3Tier.read_page does for each object
            head, _, page = self._buffers()
            bad = read_into_host(self.caps, self.ns, self.keys[i], self.rows, i * P, head, page, job.publish)
            assert bad is None, bad

        _parallel(threads or self.threads, [lambda job, i=i: read_page(job, i) for i in range(len(self.data))])

    def check(self) -> bool:
        return all(torch.equal(self.host.page(i).reshape(-1), page) for i, page in enumerate(self.data))


class _KeyedLibraryPath(_LibraryPath):
    """The library with a deployment secret: every object sealed and
    checked with keyed BLAKE3 over header and payload (``l3.auth``)."""

    def __init__(self, data: list[torch.Tensor], ns: L3Namespace, row: int, threads: int) -> None:
        super().__init__(data, dataclasses.replace(ns, seal=ObjectSeal.keyed(os.urandom(32))), row, threads)


PATHS = {"raw": _RawPath, "hicachefile": _HiCacheFilePath, "library": _LibraryPath, "library_keyed": _KeyedLibraryPath}


def _timed(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    """Seconds ``fn`` takes; ``before`` (poisoning the destination) runs untimed."""
    if before is not None:
        before()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_kind(kind: str, pages: int, threads: int, root: Path, rounds: int) -> dict[str, Any]:
    """Write then read ``pages`` pages on each path, ``rounds`` times, the
    paths' order rotated each round (the first writer into a fresh page cache
    pays for it), every round into a fresh directory; the median of the
    rounds is reported, then one page-cache-cold read per path."""
    row = KINDS[kind]
    ns = _namespace(kind if kind == "kv" else "indexer", row)
    data = [torch.randint(0, 256, (ns.page_bytes,), dtype=torch.uint8) for _ in range(pages)]
    total = pages * ns.page_bytes
    paths = {name: cls(data, ns, row, threads) for name, cls in PATHS.items()}
    names = list(paths)
    samples: dict[str, dict[str, list[float]]] = {name: {"write": [], "read": []} for name in names}
    one_thread: list[float] = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            path, directory = paths[name], root / f"{name}-{kind}-{r}"
            directory.mkdir()
            samples[name]["write"].append(_timed(lambda: path.write(directory)))
            samples[name]["read"].append(_timed(path.read, path.poison))
            assert path.check(), f"{name} read back other bytes"
            if name == "library":
                one_thread.append(_timed(lambda: path.read(1), path.poison))
                assert path.check()
            if r < rounds - 1:
                shutil.rmtree(directory)
    out: dict[str, Any] = {"page_bytes": ns.page_bytes, "pages": pages, "rounds": rounds}
    for name in names:
        for op in ("write", "read"):
            out[f"{name}_{op}_GBps"] = _gbps(total, statistics.median(samples[name][op]))
            out[f"{name}_{op}_GBps_rounds"] = [_gbps(total, x) for x in samples[name][op]]
    out["library_read_1thread_GBps"] = _gbps(total, statistics.median(one_thread))
    for name in names:
        path = paths[name]
        _drop_cache(path.directory if name == "raw" else root / f"{name}-{kind}-{rounds - 1}")
        out[f"{name}_read_cold_GBps"] = _gbps(total, _timed(path.read, path.poison))
        assert path.check(), f"{name} read back other bytes (cold)"
    for name in ("raw", "hicachefile"):
        for op in ("read", "write"):
            for lib in ("library", "library_keyed"):
                out[f"{lib}_over_{name}_{op}"] = round(out[f"{lib}_{op}_GBps"] / out[f"{name}_{op}_GBps"], 3)
    return out


class _KvHost:
    """The KV host pool as HostL3Tier reads it (layer_first)."""

    def __init__(self, pages: int) -> None:
        self.kv_buffer = torch.zeros((LAYERS, pages * P, 1, KV_ROW), dtype=torch.uint8)
        self.kv_cache_dim, self.layer_num, self.layout, self.page_size = KV_ROW, LAYERS, "layer_first", P

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + P]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + P] = data.reshape(LAYERS, P, 1, KV_ROW)


class _IndexerHost:
    def __init__(self, pages: int) -> None:
        self.index_k_with_scale_buffer = torch.zeros((LAYERS, pages, P * INDEXER_ROW), dtype=torch.uint8)
        self.indexer_page_stride_size, self.layer_num, self.page_size = P * INDEXER_ROW, LAYERS, P

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.index_k_with_scale_buffer[:, index // P]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.index_k_with_scale_buffer[:, index // P] = data.reshape(LAYERS, P * INDEXER_ROW)


def bench_prefix(tokens: int, cp_sizes: list[int], threads: int, root: Path) -> dict[str, Any]:
    """One CP rank's restore of its pages of a ``tokens``-token prefix."""
    pages = -(-tokens // P)
    directory = root / "prefix"
    store = FilePageStore(directory)
    hashes = _hashes(pages, 3)
    writer = HostL3Tier(store, CpPlacement(P, 1, 0), _KvHost(pages), _IndexerHost(pages), model_id="bench",
                        page_hasher=lambda *a, **k: [])
    writer.kv_host.kv_buffer.random_(0, 256)
    writer.indexer_host.index_k_with_scale_buffer.random_(0, 256)
    t = time.perf_counter()
    snap = writer.snapshot_pages(hashes, [0] * pages, [i * P for i in range(pages)])
    assert all(writer.store_page(kv_key, idx_key, kv, idx)
               for (kv_key, idx_key), kv, idx in zip(writer.snapshot_keys(snap), snap.kv, snap.indexer))
    out: dict[str, Any] = {"prefix_tokens": tokens, "pages": pages, "write_seconds_cp1": round(time.perf_counter() - t, 3)}
    kv_keys, idx_keys = writer.chain_keys(hashes)
    page_bytes = writer.kv_ns.page_bytes + writer.indexer_ns.page_bytes
    for cold in (False, True):
        for n in cp_sizes:
            mine = list(range(0, pages, n))  # rank 0 of CP n: every n-th page
            reader = HostL3Tier(store, CpPlacement(P, 1, 0), _KvHost(len(mine)), _IndexerHost(len(mine)),
                                model_id="bench", page_hasher=lambda *a, **k: [])
            if cold:
                _drop_cache(directory)
            t = time.perf_counter()
            ok = _parallel(threads, [
                lambda job, j=j, i=i: reader.read_page(kv_keys[i], idx_keys[i], j * P, job.publish)
                for j, i in enumerate(mine)
            ])
            seconds = time.perf_counter() - t
            assert all(ok)
            assert torch.equal(reader.kv_host.kv_buffer[:, P:2 * P], writer.kv_host.kv_buffer[:, n * P:(n + 1) * P]) \
                if len(mine) > 1 else True
            key = f"cp{n}{'_cold' if cold else ''}"
            out[f"restore_seconds_{key}"] = round(seconds, 3)
            out[f"restore_GBps_{key}"] = _gbps(len(mine) * page_bytes, seconds)
            out[f"pages_per_rank_cp{n}"] = len(mine)
    return out


def bench_checksums() -> dict[str, float]:
    """GB/s of each checksum candidate importable here, on 64 MiB."""
    data = memoryview(os.urandom(64 << 20))
    candidates: dict[str, Callable[[memoryview], int]] = {"zlib.crc32": zlib.crc32}
    try:
        import xxhash

        candidates.update({"xxh3_64": xxhash.xxh3_64_intdigest, "xxh3_128": xxhash.xxh3_128_intdigest})
    except ImportError:
        pass
    for name, module, fn in (("crc32c", "crc32c", "crc32c"), ("isal.crc32", "isal.isal_zlib", "crc32")):
        try:
            candidates[name] = getattr(__import__(module, fromlist=[fn]), fn)
        except ImportError:
            pass
    out = {}
    for name, fn in candidates.items():
        fn(data)
        t = time.perf_counter()
        for _ in range(5):
            fn(data)
        out[f"{name}_GBps"] = _gbps(5 * len(data), time.perf_counter() - t)
    return out


def _mac_candidates() -> dict[str, Callable[[list[memoryview]], bytes]]:
    """Keyed MACs over a page's runs (streamed, as a host page is checked),
    beside the unkeyed XXH3-64 of today's objects."""
    import blake3
    import xxhash

    key = os.urandom(32)

    def streamed(make: Callable[[], Any]) -> Callable[[list[memoryview]], bytes]:
        def run(parts: list[memoryview]) -> bytes:
            state = make()
            for part in parts:
                state.update(part)
            return state.digest()
        return run

    return {
        "xxh3_64 (unkeyed)": streamed(xxhash.xxh3_64),
        "blake3 keyed": streamed(lambda: blake3.blake3(key=key)),
        "hmac-sha256": streamed(lambda: hmac.new(key, digestmod="sha256")),
        "blake2b keyed": streamed(lambda: hashlib.blake2b(key=key, digest_size=32)),
    }


def bench_macs(threads: int) -> dict[str, Any]:
    """GB/s of each MAC candidate over one DeepSeek-V3.2 page, as a host page
    is checked (61 layer runs) and whole, on one thread and on ``threads``
    at once (a MAC that holds the GIL does not scale), and the microseconds
    one page's check costs on one thread."""
    out: dict[str, Any] = {}
    for kind, row in KINDS.items():
        run = P * row
        data = memoryview(os.urandom(LAYERS * run))
        shapes = {"runs": [data[i * run:(i + 1) * run] for i in range(LAYERS)], "whole": [data]}
        reps = max(8, (256 << 20) // len(data))
        for name, mac in _mac_candidates().items():
            for shape, parts in shapes.items():
                mac(parts)
                t = time.perf_counter()
                for _ in range(reps):
                    mac(parts)
                one = time.perf_counter() - t
                out[f"{kind}_{shape}_{name}_GBps"] = _gbps(reps * len(data), one)
                if shape == "runs":
                    out[f"{kind}_{name}_us_per_page"] = round(one / reps * 1e6, 1)
            t = time.perf_counter()
            _parallel(threads, [lambda job: [mac(shapes["runs"]) for _ in range(reps // threads)]
                                for _ in range(threads)])
            out[f"{kind}_runs_{name}_GBps_{threads}threads"] = _gbps(threads * (reps // threads) * len(data),
                                                                      time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--pages", type=int, default=64, help="pages per path and kind (default 64)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("SGLANG_CP_HICACHE_L3_THREADS", "4")),
                    help="the library's L3 I/O threads (default SGLANG_CP_HICACHE_L3_THREADS, else 4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the per-page comparison, median reported")
    ap.add_argument("--prefix-tokens", type=int, default=100_000)
    ap.add_argument("--cp", default="1,2,4,8", help="CP sizes of the prefix restore (default 1,2,4,8)")
    ap.add_argument("--dir", default=None, help="where to write (default: a new directory under /tmp)")
    ap.add_argument("--out", default=None, help="JSON output (default: a new file under build/bench-results)")
    args = ap.parse_args()
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    ensure_sglang_importable()
    root = Path(tempfile.mkdtemp(prefix="bench-l3-", dir=args.dir))
    started = time.time()
    try:
        result: dict[str, Any] = {
            "command": "python bench/bench_l3.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                              vars(args).items() if v is not None and k != "out"),
            "threads": args.threads,
            "cpus": os.cpu_count(),
            "load_average_before": os.getloadavg(),
            "checksums": bench_checksums(),
            "macs": bench_macs(args.threads),
        }
        for kind in KINDS:
            result[kind] = bench_kind(kind, args.pages, args.threads, root, args.rounds)
        result["prefix"] = bench_prefix(args.prefix_tokens, [int(x) for x in args.cp.split(",")], args.threads, root)
        result["load_average_after"] = os.getloadavg()
        result["seconds"] = round(time.time() - started, 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = Path(out_path(args.out, "l3", ".json"))
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "prefix"}, indent=1))
    print(json.dumps(result["prefix"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
