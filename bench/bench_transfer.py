"""Host <-> device page-copy bandwidth: D2H all-layer backup, H2D one-layer load.

GPU mode (the default when CUDA is available) sweeps

* buffers: ``indexer`` (8,448 B pages), ``kv_fp8`` (41,984 B), ``kv_bf16`` (73,728 B),
  page_size 64 (DSA);
* pages per call: 1 .. 4096 logical pages, laid out as a sequence's pages sit
  in a CP-shared pool: groups of ``cp_size`` consecutive logical pages (one per
  owner, round robin) scattered over the pool, scattered host pages; the
  benchmark runs rank 0, so at CP 8 it owns 1 page in 8 and skips 7;
* CP sizes: 1, 2, 8 (``--cp-sizes``); bytes and GB/s count the owned pages;
* providers: ``triton`` (this library's kernels, swept over CTA count and, at
  a few points, block bytes and host layouts), ``torch_staged`` (GPU
  ``index_select`` / ``index_copy_`` through a device staging buffer plus one
  bulk DMA; it assumes the host pages are contiguous, an advantage the other
  providers do not get), ``direct`` (one cudaMemcpyAsync per page and layer,
  what SGLang's ``direct`` io backend does);

and measures the link ceiling (one large pinned-memory copy per direction).
Before timing it checks the compiled kernels bitwise against the torch
reference on the GPU for every buffer and host layout, and that a backup and
a load run under ``torch.cuda.set_sync_debug_mode("error")``.

CPU mode (``--cpu``, or no CUDA) times the plain-torch reference backend (the
CPU copy path of a server without ``TRITON_INTERPRET``) on a small sweep
against a plain memcpy ceiling.

Output: a long-format CSV (one row per measurement) and one PNG per direction
with the ceiling drawn, in ``--out`` (default: a new directory
``build/bench-results/transfer_<UTC time>``; name ``--out bench/results`` to
replace the committed figures).

Usage::

    python bench/bench_transfer.py --quick          # GPU: ~1 min on an H200
    python bench/bench_transfer.py                  # GPU: full sweep, a few minutes
    python bench/bench_transfer.py --cpu            # CPU reference backend
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from sglang_cp_hicache.kernels import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_NUM_CTAS,
    HOST_LAYOUTS,
    _triton_launch,
    reference,
    warmup,
)
from sglang_cp_hicache.placement import CpPlacement

from bench_paths import new_out_path

PAGE_SIZE = 64  # DSA pages

# buffer -> (kv?, dtype, elements per row); page bytes = 8448 / 41984 / 73728
KINDS = {
    "indexer": (False, torch.uint8, 132 * PAGE_SIZE),
    "kv_fp8": (True, torch.uint8, 656),
    "kv_bf16": (True, torch.bfloat16, 576),
}

CSV_FIELDS = [
    "kernel", "provider", "direction", "host_layout", "cp_size", "page_bytes", "num_pages", "owned_pages",
    "num_layers",
    "ctas", "block_bytes", "bytes", "reps", "p20_ms", "p50_ms", "p80_ms", "gbps", "pct_of_ceiling",
    "ceiling_gbps", "device", "torch", "triton", "cuda", "git_sha", "timestamp",
]


# ----------------------------------------------------------------------------- environment
def git_sha(override: str | None) -> str:
    if override:
        return override
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def env_info(device: torch.device, sha: str) -> dict:
    import triton

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return dict(device=name, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda or "", git_sha=sha,
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


# ----------------------------------------------------------------------------- timing
# ~50 us at the ~2 GHz SM clocks of H100/H200: longer than one launch's CPU cost.
_SPIN_CYCLES = 100_000

def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def time_gpu(fn: Callable[[], None], target_s: float, max_reps: int = 100) -> list[float]:
    """Per-call GPU time in ms from CUDA events.

    Each call is queued behind a ~50 us spin kernel so the CPU-side launch cost
    (argument checks, Python) overlaps the GPU and the events time the copy
    itself; a provider whose CPU side is slower than its GPU side (``direct``
    with thousands of memcpys) is still timed by its issue rate.
    """
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(5, target_s / once)))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


def time_cpu(fn: Callable[[], None], target_s: float, max_reps: int = 50) -> list[float]:
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(5, target_s / once)))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_ceiling(device: torch.device, nbytes: int, target_s: float) -> dict[str, float]:
    """GB/s of one large contiguous copy per direction (pinned host memory on CUDA)."""
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        d2h = time_gpu(lambda: host.copy_(dev, non_blocking=True), target_s, 30)
        h2d = time_gpu(lambda: dev.copy_(host, non_blocking=True), target_s, 30)
    else:
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        d2h = time_cpu(lambda: b.copy_(a), target_s, 20)
        h2d = time_cpu(lambda: a.copy_(b), target_s, 20)
    return {d: nbytes / (percentile(t, 0.5) * 1e-3) / 1e9 for d, t in (("d2h", d2h), ("h2d", h2d))}


# ----------------------------------------------------------------------------- pools
@dataclass
class Pools:
    kind: str
    host_layout: str
    num_layers: int
    num_pages: int  # per device layer and in the host buffer
    devs: list[torch.Tensor]
    host: torch.Tensor
    page_bytes: int = 0
    dev_pages: list[torch.Tensor] = field(default_factory=list)  # (pages, page_bytes) uint8 views
    host_pages: torch.Tensor | None = None  # (layers, pages, page_bytes) uint8 view (layer_first only)

    @property
    def kv(self) -> bool:
        return KINDS[self.kind][0]


def make_pools(kind: str, host_layout: str, num_layers: int, num_pages: int, device: torch.device) -> Pools:
    kv, dtype, row = KINDS[kind]
    pin = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)

    def alloc(shape, on_device: bool):
        """Device buffers get random bytes, the host buffer 0xA5 poison."""
        elem = torch.empty((), dtype=dtype).element_size()
        raw = torch.empty((*shape[:-1], shape[-1] * elem), dtype=torch.uint8, device=device if on_device else "cpu")
        if on_device:
            raw.random_(0, 256, generator=gen)
        else:
            raw.fill_(0xA5)
        return raw.view(dtype)

    if kv:
        slots = num_pages * PAGE_SIZE
        devs = [alloc((slots, 1, row), True) for _ in range(num_layers)]
        shape = {"layer_first": (num_layers, slots, 1, row), "page_first": (slots, num_layers, 1, row),
                 "page_first_direct": (num_pages, num_layers, PAGE_SIZE, 1, row)}[host_layout]
    else:
        devs = [alloc((num_pages, row), True) for _ in range(num_layers)]
        shape = (num_layers, num_pages, row) if host_layout == "layer_first" else (num_pages, num_layers, 1, row)
    host = alloc(shape, False)
    if pin:
        host = host.pin_memory()
    page_bytes = row * torch.empty((), dtype=dtype).element_size() * (PAGE_SIZE if kv else 1)
    pools = Pools(kind, host_layout, num_layers, num_pages, devs, host, page_bytes)
    pools.dev_pages = [d.view(torch.uint8).view(-1, page_bytes) for d in devs]
    if host_layout == "layer_first":
        pools.host_pages = host.view(torch.uint8).view(num_layers, -1, page_bytes)
    return pools


def make_batch(num_pages: int, pool_pages: int, placement: CpPlacement, device, seed: int):
    """``num_pages`` logical pages with the real owner mix, for ``placement``'s rank.

    A sequence's pages sit in a CP-shared pool as groups of ``cp_size``
    consecutive logical pages, one per owner (round robin); the groups are
    scattered over the pool (``pool_pages`` physical pages per rank), and the
    owned pages go to scattered host pages. Returns (device_locs, host_locs,
    physical pages of the owned ones, their host pages).
    """
    g = torch.Generator().manual_seed(seed)
    n, r = placement.cp_size, placement.cp_rank
    groups = torch.randperm(pool_pages, generator=g)[: -(-num_pages // n)]
    logical = (groups[:, None] * n + torch.arange(n)).flatten()[:num_pages]
    owned = logical[logical % n == r]
    host_pages = torch.randperm(pool_pages, generator=g)[: owned.numel()]
    to_locs = lambda pages: (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten().to(torch.int64)
    return to_locs(logical).to(device), to_locs(host_pages).to(device), owned // n, host_pages


# ----------------------------------------------------------------------------- providers
def triton_call(p: Pools, direction, dl, hl, placement, ctas, block_bytes):
    kw = dict(num_ctas=ctas, block_bytes=block_bytes)
    if p.kv:
        if direction == "d2h":
            return lambda: _triton_launch.backup_kv_all_layers(p.devs, p.host, p.host_layout, dl, hl, placement, **kw)
        return lambda: _triton_launch.load_kv_one_layer(p.devs[0], p.host, p.host_layout, 0, dl, hl, placement, **kw)
    if direction == "d2h":
        return lambda: _triton_launch.backup_indexer_all_layers(p.devs, p.host, p.host_layout, dl, hl, placement, **kw)
    return lambda: _triton_launch.load_indexer_one_layer(p.devs[0], p.host, p.host_layout, 0, dl, hl, placement, **kw)


def reference_call(p: Pools, direction, dl, hl, placement):
    if p.kv:
        if direction == "d2h":
            return lambda: reference.backup_kv_all_layers_reference(p.devs, p.host, p.host_layout, dl, hl, placement)
        return lambda: reference.load_kv_one_layer_reference(p.devs[0], p.host, p.host_layout, 0, dl, hl, placement)
    if direction == "d2h":
        return lambda: reference.backup_indexer_all_layers_reference(p.devs, p.host, p.host_layout, dl, hl, placement)
    return lambda: reference.load_indexer_one_layer_reference(p.devs[0], p.host, p.host_layout, 0, dl, hl, placement)


def torch_staged_call(p: Pools, direction, phys_pages, host_pages, staging, pinned):
    """GPU gather/scatter through a device staging buffer + one bulk DMA.
    Host pages are taken as one contiguous run (pinned staging), which the
    real host pool does not guarantee: an optimistic baseline."""
    idx = phys_pages.to(staging.device)
    n = idx.numel()
    layers = range(p.num_layers) if direction == "d2h" else [0]

    def d2h():
        for layer in layers:
            torch.index_select(p.dev_pages[layer], 0, idx, out=staging[:n])
            pinned[layer, :n].copy_(staging[:n], non_blocking=True)

    def h2d():
        staging[:n].copy_(pinned[0, :n], non_blocking=True)
        p.dev_pages[0].index_copy_(0, idx, staging[:n])

    return d2h if direction == "d2h" else h2d


def direct_call(p: Pools, direction, phys_pages, host_pages):
    """One cudaMemcpyAsync per page and layer into the scattered host pages."""
    layers = range(p.num_layers) if direction == "d2h" else [0]
    dsts, srcs = [], []
    for layer in layers:
        for d, h in zip(phys_pages.tolist(), host_pages.tolist()):
            dev_page, host_page = p.dev_pages[layer][d], p.host_pages[layer][h]
            if direction == "d2h":
                dsts.append(host_page), srcs.append(dev_page)
            else:
                dsts.append(dev_page), srcs.append(host_page)

    def run():  # a C++ loop of copy_ calls when available, like SGLang's
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def run_python():
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)

    try:
        run()
        if p.host.is_pinned():
            torch.cuda.synchronize()
        return run
    except (RuntimeError, AttributeError, NotImplementedError):
        return run_python


# ----------------------------------------------------------------------------- GPU checks
def gpu_checks(device) -> dict:
    """Compiled kernels vs the reference, bitwise, on the GPU; no host syncs."""
    results = {"bitwise": {}, "sync_free": {}}
    placement = CpPlacement(PAGE_SIZE, 2, 1)
    for kind in KINDS:
        for hl in HOST_LAYOUTS:
            a = make_pools(kind, hl, 3, 16, device)
            dl, hloc, _, _ = make_batch(12, 16, placement, device, seed=1)
            b = Pools(kind, hl, 3, 16, [d.clone() for d in a.devs], a.host.clone(), a.page_bytes)
            ok = True
            # backup into the poisoned host buffer, then load back into a poisoned
            # device layer with another grid shape
            for direction, ctas, block in (("d2h", DEFAULT_NUM_CTAS, DEFAULT_BLOCK_BYTES), ("h2d", 3, 4096)):
                if direction == "h2d":
                    a.devs[0].view(torch.uint8).fill_(0x5A)
                    b.devs[0].view(torch.uint8).fill_(0x5A)
                triton_call(a, direction, dl, hloc, placement, ctas, block)()
                reference_call(b, direction, dl, hloc, placement)()
                torch.cuda.synchronize()
                ok &= torch.equal(a.host.view(torch.uint8), b.host.view(torch.uint8))
                ok &= all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.devs, b.devs))
            results["bitwise"][f"{kind}/{hl}"] = bool(ok)
            torch.cuda.set_sync_debug_mode("error")
            try:
                triton_call(a, "d2h", dl, hloc, placement, DEFAULT_NUM_CTAS, DEFAULT_BLOCK_BYTES)()
                triton_call(a, "h2d", dl, hloc, placement, DEFAULT_NUM_CTAS, DEFAULT_BLOCK_BYTES)()
                results["sync_free"][f"{kind}/{hl}"] = True
            except RuntimeError as exc:
                results["sync_free"][f"{kind}/{hl}"] = f"synced: {exc}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    return results


# ----------------------------------------------------------------------------- sweeps
@dataclass
class Sweep:
    kinds: tuple
    pages: tuple
    ctas: tuple
    blocks: tuple  # extra block_bytes values, timed at (block_ctas x block_pages), CP 1
    block_ctas: tuple
    block_pages: tuple
    layout_pages: tuple  # pages at which the other host layouts are timed (triton only, CP 1)
    direct_max_pages: int
    num_layers: int
    target_s: float
    cp_sizes: tuple


def gpu_sweep(args, device) -> Sweep:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    kinds = tuple(args.kinds or KINDS)
    if args.quick:
        return Sweep(kinds, tuple(args.pages or (1, 64, 1024)), (1, 4, 16), (), (), (), (256,), 1024,
                     args.layers, 0.05, tuple(args.cp_sizes))
    return Sweep(kinds, tuple(args.pages or (1, 4, 16, 64, 256, 1024, 4096)),
                 tuple(sorted({1, 2, 4, 8, 16, 32, sms})), (8192, 65536), (4, 16), (256, 4096), (16, 1024),
                 4096, args.layers, 0.12, tuple(args.cp_sizes))


def make_row(*, kind, provider, direction, hl, cp_size, page_bytes, num_pages, owned_pages, num_layers,
             ctas, block, times, ceiling, info) -> dict:
    """One CSV row; bytes and GB/s count the owned pages only (the ones moved)."""
    n_bytes = owned_pages * page_bytes * num_layers
    p50 = percentile(times, 0.5)
    gbps = n_bytes / (p50 * 1e-3) / 1e9
    return dict(
        kernel=kind, provider=provider, direction=direction, host_layout=hl, cp_size=cp_size,
        page_bytes=page_bytes, num_pages=num_pages, owned_pages=owned_pages, num_layers=num_layers,
        ctas=ctas, block_bytes=block, bytes=n_bytes, reps=len(times),
        p20_ms=round(percentile(times, 0.2), 5), p50_ms=round(p50, 5), p80_ms=round(percentile(times, 0.8), 5),
        gbps=round(gbps, 3), pct_of_ceiling=round(100 * gbps / ceiling[direction], 2),
        ceiling_gbps=round(ceiling[direction], 3), **info,
    )


def run_gpu(args) -> tuple[list[dict], dict, dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    info = env_info(device, git_sha(args.git_sha))
    sweep = gpu_sweep(args, device)
    t_start = time.perf_counter()
    meta: dict = {"mode": "gpu", "quick": args.quick, **info}

    t0 = time.perf_counter()
    reports = [
        warmup(page_size=PAGE_SIZE, host_layout=hl, num_layers=sweep.num_layers,
               kv_dim=KINDS[k][2], kv_dtype=KINDS[k][1], device=device)
        for hl in HOST_LAYOUTS for k in ("kv_fp8", "kv_bf16")
    ] + [warmup(page_size=PAGE_SIZE, host_layout=hl, num_layers=sweep.num_layers,
                indexer_page_bytes=KINDS["indexer"][2], device=device) for hl in HOST_LAYOUTS]
    compiled = sum(r.compiled for r in reports)
    meta["warmup"] = {"kernels": compiled, "seconds": round(time.perf_counter() - t0, 2),
                      "cache_dir": reports[0].cache_dir}
    print(f"warmup: {compiled} kernels in {meta['warmup']['seconds']} s", flush=True)

    meta["checks"] = gpu_checks(device)
    print("checks:", json.dumps(meta["checks"]), flush=True)

    ceiling = measure_ceiling(device, 1 << 30, 0.3)
    meta["ceiling_gbps"] = ceiling
    print(f"ceiling: d2h {ceiling['d2h']:.1f} GB/s, h2d {ceiling['h2d']:.1f} GB/s", flush=True)

    rows = []

    def out_of_time() -> bool:
        return time.perf_counter() - t_start > args.time_budget_s

    def record(**kw):
        row = make_row(ceiling=ceiling, info=info, **kw)
        rows.append(row)
        print(f"{row['kernel']:8s} {row['provider']:12s} {row['direction']} {row['host_layout']:17s} "
              f"cp={row['cp_size']} pages={row['num_pages']:5d} ctas={row['ctas']!s:4s} "
              f"block={row['block_bytes']!s:6s} {row['p50_ms'] * 1e3:9.1f} us {row['gbps']:7.2f} GB/s", flush=True)

    for kind in sweep.kinds:
        for hl in HOST_LAYOUTS:
            main = hl == args.host_layout
            sizes = sweep.pages if main else sweep.layout_pages
            pool_pages = max(sizes)
            pools = make_pools(kind, hl, sweep.num_layers, pool_pages, device)
            staging = pinned = None
            if main:
                staging = torch.empty(pool_pages, pools.page_bytes, dtype=torch.uint8, device=device)
                pinned = torch.empty(sweep.num_layers, pool_pages, pools.page_bytes, dtype=torch.uint8,
                                     pin_memory=True)
            for cp_size in sweep.cp_sizes if main else (1,):
                placement = CpPlacement(PAGE_SIZE, cp_size, 0)
                for num_pages in sizes:
                    dl, hloc, phys, hpages = make_batch(num_pages, pool_pages, placement, device, num_pages)
                    common = dict(kind=kind, hl=hl, cp_size=cp_size, page_bytes=pools.page_bytes,
                                  num_pages=num_pages, owned_pages=phys.numel())
                    for direction in ("d2h", "h2d"):
                        if out_of_time():
                            break
                        L = sweep.num_layers if direction == "d2h" else 1
                        points = [(c, DEFAULT_BLOCK_BYTES) for c in (sweep.ctas if main else (DEFAULT_NUM_CTAS, 16))]
                        if main and cp_size == 1 and num_pages in sweep.block_pages:
                            points += [(c, b) for b in sweep.blocks for c in sweep.block_ctas]
                        for ctas, block in points:
                            fn = triton_call(pools, direction, dl, hloc, placement, ctas, block)
                            record(provider="triton", direction=direction, num_layers=L, ctas=ctas, block=block,
                                   times=time_gpu(fn, sweep.target_s), **common)
                        if not main or pools.host_pages is None:  # baselines index layer_first pages
                            continue
                        # Baselines get the owned pages' physical and host pages
                        # ready-made (a device->host sync in real use).
                        fn = torch_staged_call(pools, direction, phys, hpages, staging, pinned)
                        record(provider="torch_staged", direction=direction, num_layers=L, ctas="", block="",
                               times=time_gpu(fn, sweep.target_s), **common)
                        if phys.numel() <= sweep.direct_max_pages:
                            fn = direct_call(pools, direction, phys, hpages)
                            record(provider="direct", direction=direction, num_layers=L, ctas="", block="",
                                   times=time_gpu(fn, sweep.target_s), **common)
            del pools, staging, pinned
            torch.cuda.empty_cache()
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    meta["truncated_by_time_budget"] = out_of_time()
    return rows, ceiling, meta


def run_cpu(args) -> tuple[list[dict], dict, dict]:
    # The reference's ops are small: on a shared 2-vCPU machine, waking a
    # second intra-op thread per op cost ~40 ms per call (measured), 100x the
    # single-thread time. One thread unless --threads says otherwise.
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    info = env_info(device, git_sha(args.git_sha))
    t_start = time.perf_counter()
    pages = tuple(args.pages or ((1, 16, 256) if args.quick else (1, 4, 16, 64, 256)))
    target = 0.05 if args.quick else 0.2
    ceiling = measure_ceiling(device, args.ceiling_mib << 20, 0.5)
    print(f"ceiling (memcpy): {ceiling['d2h']:.1f} GB/s", flush=True)
    rows = []
    for kind in args.kinds or KINDS:
        pools = make_pools(kind, args.host_layout, args.layers, max(pages), device)
        for cp_size in args.cp_sizes:
            placement = CpPlacement(PAGE_SIZE, cp_size, 0)
            for num_pages in pages:
                dl, hloc, phys, _ = make_batch(num_pages, max(pages), placement, device, num_pages)
                for direction in ("d2h", "h2d"):
                    L = args.layers if direction == "d2h" else 1
                    times = time_cpu(reference_call(pools, direction, dl, hloc, placement), target)
                    row = make_row(kind=kind, provider="reference", direction=direction, hl=args.host_layout,
                                   cp_size=cp_size, page_bytes=pools.page_bytes, num_pages=num_pages,
                                   owned_pages=phys.numel(), num_layers=L, ctas="", block="", times=times,
                                   ceiling=ceiling, info=info)
                    rows.append(row)
                    print(f"{kind:8s} reference {direction} cp={cp_size} pages={num_pages:4d} "
                          f"{row['p50_ms']:8.3f} ms {row['gbps']:6.2f} GB/s", flush=True)
    meta = {"mode": "cpu", "quick": args.quick, **info, "ceiling_gbps": ceiling,
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(), "seconds": round(time.perf_counter() - t_start, 1)}
    return rows, ceiling, meta


# ----------------------------------------------------------------------------- output
def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow(row)


def _series_label(r: dict, main_layout: str) -> str | None:
    """Legend entry of a row, or None for rows the plot leaves out (other host
    layouts and block sizes; CTA sweeps other than the default at CP > 1)."""
    cp = int(r["cp_size"])
    if r["provider"] != "triton":
        return f"{r['provider']} cp{cp}"
    if r["host_layout"] != main_layout or r["block_bytes"] != DEFAULT_BLOCK_BYTES:
        return None
    if cp != 1 and r["ctas"] != DEFAULT_NUM_CTAS:
        return None
    return f"triton cp{cp} {r['ctas']} CTAs"


def plot(rows: list[dict], ceiling: dict, direction: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if any(r["kernel"] == k and r["direction"] == direction for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [r for r in rows if r["kernel"] == kind and r["direction"] == direction]
        main_layout = sel[0]["host_layout"]
        series: dict[str, list] = {}
        for r in sel:
            label = _series_label(r, main_layout)
            if label is not None:
                series.setdefault(label, []).append((r["num_pages"], r["gbps"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            style = dict(marker="o", ms=3, lw=1.2) if label.startswith("triton") else dict(marker="s", ms=4, lw=2, ls="--")
            ax.plot([p for p, _ in pts], [g for _, g in pts], label=label, **style)
        ax.axhline(ceiling[direction], color="k", lw=1.5, ls=":", label=f"ceiling {ceiling[direction]:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("logical pages per call (rank 0 owns 1 in cp)")
        ax.set_title(f"{kind} ({sel[0]['page_bytes']} B pages, {sel[0]['num_layers']} layer(s))")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("GB/s of owned pages moved")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sweep")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="CPU mode (reference backend) even if CUDA is available")
    mode.add_argument("--gpu", action="store_true", help="GPU mode; an error if CUDA is not available")
    ap.add_argument("--out", default=None,
                    help="results directory (default: a new build/bench-results/transfer_<UTC time>)")
    ap.add_argument("--layers", type=int, default=4, help="layers in the device pool (backups copy all)")
    ap.add_argument("--cp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 8],
                    help="comma-separated CP group sizes (real owner mix; the benchmark runs rank 0)")
    ap.add_argument("--host-layout", default="layer_first", choices=HOST_LAYOUTS,
                    help="host layout of the full sweep (the others get a few triton points)")
    ap.add_argument("--time-budget-s", type=float, default=420.0,
                    help="GPU mode: stop sweeping after this long and write what was measured")
    ap.add_argument("--git-sha", default=None, help="recorded in the CSV (default: git rev-parse HEAD)")
    ap.add_argument("--pages", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated pages per call (overrides the sweep's)")
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=None,
                    help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--ceiling-mib", type=int, default=256, help="CPU mode: size of the memcpy ceiling copy")
    ap.add_argument("--threads", type=int, default=1, help="CPU mode: torch intra-op threads")
    args = ap.parse_args(argv)
    args.out = args.out or new_out_path("transfer")
    unknown = sorted(set(args.kinds or ()) - set(KINDS))
    if unknown:
        ap.error(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    if any(n < 1 for n in args.cp_sizes):
        ap.error(f"--cp-sizes: every size must be >= 1, got {args.cp_sizes}")

    if args.gpu and not torch.cuda.is_available():
        ap.error("--gpu: CUDA is not available")
    gpu = torch.cuda.is_available() and not args.cpu
    os.makedirs(args.out, exist_ok=True)
    rows, ceiling, meta = run_gpu(args) if gpu else run_cpu(args)
    mode = "gpu" if gpu else "cpu"
    suffix = f"{mode}{'_quick' if args.quick else ''}"
    csv_path = os.path.join(args.out, f"transfer_{suffix}.csv")
    write_csv(rows, csv_path)
    with open(os.path.join(args.out, f"transfer_{suffix}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for direction, what in (("d2h", "D2H all-layer backup"), ("h2d", "H2D one-layer load")):
        title = f"{what} - {meta['device']} - {'Triton kernels vs baselines' if gpu else 'torch reference backend'}"
        plot(rows, ceiling, direction, os.path.join(args.out, f"transfer_{suffix}_{direction}.png"), title)
    print(f"wrote {csv_path} ({len(rows)} rows) in {meta['seconds']} s", flush=True)
    if gpu:
        checks = meta["checks"]
        bad = [k for k, v in checks["bitwise"].items() if v is not True]
        bad += [k for k, v in checks["sync_free"].items() if v is not True]
        if bad:
            print(f"CHECKS FAILED: {bad}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
