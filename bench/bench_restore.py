"""Restore and write-through backup of a DeepSeek-V3.2-sized prefix, per CP rank.

What one rank moves when a 100K-token prefix comes back from the host tier
(61 layers, page size 64): for every layer, as the server loads it, one
``load_kv_one_layer`` and one ``load_indexer_one_layer`` through
``sglang_cp_hicache.kernels.transfer``; and the write-through backup of the
same prefix (``backup_kv_all_layers`` + ``backup_indexer_all_layers``).

* KV: 656 B/token (fp8, ``kv_dim`` 656 uint8) or 1,152 B/token (bf16, 576
  elements); indexer: 132 B/token (page major, 8,448 B pages).
* CP 1, 2 and 8 with the real owner mix: the chain's logical pages come in
  groups of ``cp_size`` consecutive pages, one per owner (round robin),
  scattered over the device pool; the rank (0 by default) owns ~1/N of them,
  at scattered host slots.
* Milliseconds per whole restore / backup (CUDA events on an idle GPU, so the
  CPU side of 122 launches counts), GB/s of the owned pages' bytes, and the
  ceiling: one plain contiguous pinned copy of the same byte count in the
  same direction.
* Bit-exact: every owned page restored equals its source page
  (``torch.equal``), into a poisoned destination whose other pages stay
  poisoned; the backup's host slots equal the source pages and the host
  slots it was not given stay poisoned. Exit 1 on any mismatch.

``--cpu`` runs the same script on CPU tensors at a small size (2,048 tokens,
4 layers; Triton's interpreter under ``TRITON_INTERPRET=1``, else the torch
reference) to test it; its rows say ``cpu`` and are no GPU result.

Output in ``--out``: ``restore_<device>.csv`` and ``restore_<device>.json``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from sglang_cp_hicache.kernels import HOST_LAYOUTS, transfer
from sglang_cp_hicache.placement import DSA_PAGE_SIZE, CpPlacement

POISON = 0xA5
INDEXER_TOKEN_BYTES = 132  # 128 fp8 key bytes + a 4-byte scale per token
# KV dtype -> (element dtype, elements per token)
KV_DTYPES = {"fp8": (torch.uint8, 656), "bf16": (torch.bfloat16, 576)}

CSV_FIELDS = [
    "op", "kv_dtype", "host_layout", "cp_size", "rank", "tokens", "num_pages", "owned_pages", "num_layers",
    "kv_page_bytes", "indexer_page_bytes", "bytes", "reps", "min_ms", "p50_ms", "max_ms", "per_layer_ms",
    "gbps", "ceiling_gbps", "pct_of_ceiling", "bit_exact", "device", "backend", "torch", "triton", "git_sha",
    "timestamp",
]


@dataclass(frozen=True)
class Shape:
    """The prefix and the model: tokens, layers, page size (tokens)."""

    tokens: int
    num_layers: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return -(-self.tokens // self.page_size)


GPU_SHAPE = Shape(100_000, 61, DSA_PAGE_SIZE)
CPU_SHAPE = Shape(2_048, 4, DSA_PAGE_SIZE)


# ----------------------------------------------------------------------------- pools
@dataclass
class Pools:
    """One rank's device layers (source, poisoned destination) and one host
    arena that holds both host pools back to back and feeds the ceiling copy."""

    kv_dtype: str
    shape: Shape
    dev_pages: int  # physical pages per device layer
    kv_src: list[torch.Tensor]
    kv_dst: list[torch.Tensor]
    idx_src: list[torch.Tensor]
    idx_dst: list[torch.Tensor]
    arena: torch.Tensor  # flat uint8 host bytes (pinned on CUDA)
    ceiling_dev: torch.Tensor  # flat uint8 device bytes for the ceiling copy

    @property
    def kv_page_bytes(self) -> int:
        dtype, dim = KV_DTYPES[self.kv_dtype]
        return self.shape.page_size * dim * torch.empty((), dtype=dtype).element_size()

    @property
    def idx_page_bytes(self) -> int:
        return self.shape.page_size * INDEXER_TOKEN_BYTES


def _slack(pages: int) -> int:
    # unused pages around the used ones, so scattered placement and "others untouched" mean something
    return max(2, pages // 8)


def make_pools(kv_dtype: str, shape: Shape, device: torch.device) -> Pools:
    dtype, dim = KV_DTYPES[kv_dtype]
    dev_pages = shape.num_pages + _slack(shape.num_pages)
    gen = torch.Generator(device=device).manual_seed(0)
    P, L = shape.page_size, shape.num_layers

    def layer(shape_, random: bool) -> torch.Tensor:
        raw = torch.empty(shape_, dtype=torch.uint8, device=device)
        if random:
            raw.random_(0, 256, generator=gen)
        else:
            raw.fill_(POISON)
        return raw

    elem = torch.empty((), dtype=dtype).element_size()
    kv_src = [layer((dev_pages * P, 1, dim * elem), True).view(dtype) for _ in range(L)]
    kv_dst = [layer((dev_pages * P, 1, dim * elem), False).view(dtype) for _ in range(L)]
    idx_src = [layer((dev_pages, P * INDEXER_TOKEN_BYTES), True) for _ in range(L)]
    idx_dst = [layer((dev_pages, P * INDEXER_TOKEN_BYTES), False) for _ in range(L)]
    pools = Pools(kv_dtype, shape, dev_pages, kv_src, kv_dst, idx_src, idx_dst,
                  torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8))
    arena_bytes = dev_pages * L * (pools.kv_page_bytes + pools.idx_page_bytes)
    pools.arena = torch.empty(arena_bytes, dtype=torch.uint8)
    if device.type == "cuda":  # page-locked the way SGLang's host pools are: cudaHostRegister, exact size
        err = torch.cuda.cudart().cudaHostRegister(pools.arena.data_ptr(), arena_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {arena_bytes} bytes failed: {err}")
    pools.ceiling_dev = torch.empty(arena_bytes, dtype=torch.uint8, device=device)
    return pools


def close_pools(p: Pools) -> None:
    if p.ceiling_dev.device.type == "cuda":
        torch.cuda.synchronize(p.ceiling_dev.device)
        torch.cuda.cudart().cudaHostUnregister(p.arena.data_ptr())


def host_pools(p: Pools, host_layout: str, host_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang-shaped host KV and indexer buffers of ``host_pages`` pages, carved
    from the arena (views of the registered allocation are pinned too)."""
    dtype, dim = KV_DTYPES[p.kv_dtype]
    P, L, H = p.shape.page_size, p.shape.num_layers, host_pages
    kv_bytes = H * L * p.kv_page_bytes
    kv = p.arena[:kv_bytes].view(dtype)
    idx = p.arena[kv_bytes : kv_bytes + H * L * p.idx_page_bytes]
    kv = {"layer_first": kv.view(L, H * P, 1, dim), "page_first": kv.view(H * P, L, 1, dim),
          "page_first_direct": kv.view(H, L, P, 1, dim)}[host_layout]
    idx = idx.view(L, H, -1) if host_layout == "layer_first" else idx.view(H, L, 1, -1)
    return kv, idx


def host_page_major(t: torch.Tensor, host_layout: str, kv: bool, num_layers: int, host_pages: int) -> torch.Tensor:
    """A uint8 view of a host buffer indexed [host page, layer]; the rest of
    its dims hold that page's bytes of that layer in device order. Strided,
    no copy."""
    b = t.view(torch.uint8)
    H, L = host_pages, num_layers
    if host_layout == "layer_first":
        return b.reshape(L, H, -1).transpose(0, 1)
    if kv and host_layout == "page_first":  # token major: (H, P, L, row) -> (H, L, P, row)
        return b.reshape(H, -1, L, b.shape[-1]).transpose(1, 2)
    return b.reshape(H, L, -1)


def dev_pages_of(t: torch.Tensor, dev_pages: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(dev_pages, -1)


# ----------------------------------------------------------------------------- batches
@dataclass
class Batch:
    """One chain's pages on one rank: logical device locs, host locs of the
    owned pages, their physical device pages and host pages (CPU int64)."""

    device_locs: torch.Tensor
    host_locs: torch.Tensor
    phys_pages: torch.Tensor
    host_pages: torch.Tensor


def chain_batch(shape: Shape, dev_pages: int, placement: CpPlacement, host_pages: torch.Tensor | None,
                gen: torch.Generator, host_pool_pages: int) -> Batch:
    n, r, P = placement.cp_size, placement.cp_rank, shape.page_size
    groups = torch.randperm(dev_pages, generator=gen)[: -(-shape.num_pages // n)]
    logical = (groups[:, None] * n + torch.arange(n)).flatten()[: shape.num_pages]
    owned = logical[logical % n == r]
    if host_pages is None:
        host_pages = torch.randperm(host_pool_pages, generator=gen)[: owned.numel()]
    to_locs = lambda pages: (pages[:, None] * P + torch.arange(P)).flatten().to(torch.int64)
    return Batch(to_locs(logical), to_locs(host_pages), owned // n, host_pages)


def owned_count(shape: Shape, placement: CpPlacement) -> int:
    n, r = placement.cp_size, placement.cp_rank
    return shape.num_pages // n + (1 if r < shape.num_pages % n else 0)


# ----------------------------------------------------------------------------- copies
@dataclass
class Job:
    """One (rank, host layout) of one pool: the buffers and the two batches."""

    pools: Pools
    host_layout: str
    placement: CpPlacement
    host_kv: torch.Tensor
    host_idx: torch.Tensor
    host_pool_pages: int
    backup: Batch  # source pages -> host slots
    restore: Batch  # host slots -> other logical pages of the same owner
    backup_locs: tuple[torch.Tensor, torch.Tensor]  # on the device
    restore_locs: tuple[torch.Tensor, torch.Tensor]


def make_job(p: Pools, host_layout: str, placement: CpPlacement, seed: int) -> Job:
    device = p.kv_src[0].device
    gen = torch.Generator().manual_seed(seed)
    owned = owned_count(p.shape, placement)
    host_pool_pages = owned + _slack(owned)
    host_kv, host_idx = host_pools(p, host_layout, host_pool_pages)
    b = chain_batch(p.shape, p.dev_pages, placement, None, gen, host_pool_pages)
    r = chain_batch(p.shape, p.dev_pages, placement, b.host_pages, gen, host_pool_pages)
    assert b.phys_pages.numel() == r.phys_pages.numel() == owned
    to_dev = lambda batch: (batch.device_locs.to(device), batch.host_locs.to(device))
    return Job(p, host_layout, placement, host_kv, host_idx, host_pool_pages, b, r, to_dev(b), to_dev(r))


def run_backup(j: Job) -> None:
    dl, hl = j.backup_locs
    transfer.backup_kv_all_layers(j.pools.kv_src, j.host_kv, j.host_layout, dl, hl, j.placement)
    transfer.backup_indexer_all_layers(j.pools.idx_src, j.host_idx, j.host_layout, dl, hl, j.placement)


def run_restore(j: Job) -> None:
    """Layer by layer, KV then indexer, as the server's per-layer load does."""
    dl, hl = j.restore_locs
    p = j.pools
    for layer in range(p.shape.num_layers):
        transfer.load_kv_one_layer(p.kv_dst[layer], j.host_kv, j.host_layout, layer, dl, hl, j.placement)
        transfer.load_indexer_one_layer(p.idx_dst[layer], j.host_idx, j.host_layout, layer, dl, hl, j.placement)


# ----------------------------------------------------------------------------- checks
def check_backup(j: Job) -> str | None:
    """None if the host slots hold exactly the owned source pages and every
    other host slot is still poison, else what differed."""
    p, L = j.pools, j.pools.shape.num_layers
    used = torch.zeros(j.host_pool_pages, dtype=torch.bool)
    used[j.backup.host_pages] = True
    for name, host, srcs, kv in (("kv", j.host_kv, p.kv_src, True), ("indexer", j.host_idx, p.idx_src, False)):
        view = host_page_major(host, j.host_layout, kv, L, j.host_pool_pages)
        phys = j.backup.phys_pages.to(srcs[0].device)
        for layer in range(L):  # a layer at a time: a few contiguous rows per page, no full-size copy
            got = view[:, layer].index_select(0, j.backup.host_pages)
            want = dev_pages_of(srcs[layer], p.dev_pages).index_select(0, phys).cpu()
            if not torch.equal(got.reshape(want.shape), want):
                return f"backup: {name} layer {layer}: host pages differ from the owned source pages"
        if not bool((view[~used] == POISON).all()):
            return f"backup: {name}: a host slot outside host_locs was written"
    return None


def check_restore(j: Job) -> str | None:
    """None if each owned destination page equals the source page backed up
    to its host slot and every other destination page is still poison."""
    p = j.pools
    device = p.kv_src[0].device
    src_phys, dst_phys = j.backup.phys_pages.to(device), j.restore.phys_pages.to(device)
    untouched = torch.ones(p.dev_pages, dtype=torch.bool, device=device)
    untouched[dst_phys] = False
    for name, srcs, dsts in (("kv", p.kv_src, p.kv_dst), ("indexer", p.idx_src, p.idx_dst)):
        for layer in range(p.shape.num_layers):
            src, dst = dev_pages_of(srcs[layer], p.dev_pages), dev_pages_of(dsts[layer], p.dev_pages)
            if not torch.equal(dst.index_select(0, dst_phys), src.index_select(0, src_phys)):
                return f"restore: {name} layer {layer}: restored pages differ from their source pages"
            if not bool((dst[untouched] == POISON).all()):
                return f"restore: {name} layer {layer}: a page this rank did not restore was written"
    return None


# ----------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], None], device: torch.device, reps: int) -> list[float]:
    """Milliseconds per call, each call started on an idle device."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def ceiling_gbps(p: Pools, nbytes: int, direction: str, reps: int) -> float:
    """GB/s of one plain contiguous copy of ``nbytes`` (pinned host memory on CUDA)."""
    device = p.ceiling_dev.device
    host, dev = p.arena[:nbytes], p.ceiling_dev[:nbytes]
    fn = (lambda: dev.copy_(host, non_blocking=True)) if direction == "h2d" else (
        lambda: host.copy_(dev, non_blocking=True))
    times = time_ms(fn, device, reps + 1)[1:]
    return nbytes / (sorted(times)[len(times) // 2] * 1e-3) / 1e9


# ----------------------------------------------------------------------------- one configuration
def _sig(x: float) -> float:
    return float(f"{x:.4g}")  # 4 significant digits: CPU figures are tiny, GPU ones large


def measure(j: Job, reps: int, meta: dict) -> list[dict]:
    """Backup then restore of one job: checked once, then timed; two rows."""
    p = j.pools
    device = p.kv_src[0].device
    owned = j.backup.phys_pages.numel()
    nbytes = owned * p.shape.num_layers * (p.kv_page_bytes + p.idx_page_bytes)
    ceilings = {d: ceiling_gbps(p, nbytes, d, reps) if nbytes else 0.0 for d in ("d2h", "h2d")}
    p.arena.fill_(POISON)  # after the ceiling copies, which use the arena
    rows = []
    for op, run, check, direction in (("backup", run_backup, check_backup, "d2h"),
                                      ("restore", run_restore, check_restore, "h2d")):
        if op == "restore":
            for d in p.kv_dst + p.idx_dst:
                d.view(torch.uint8).fill_(POISON)
        run(j)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        err = check(j)
        times = time_ms(lambda: run(j), device, reps)
        p50 = sorted(times)[len(times) // 2]
        gbps = nbytes / (p50 * 1e-3) / 1e9
        rows.append({
            **meta, "op": op, "kv_dtype": p.kv_dtype, "host_layout": j.host_layout,
            "cp_size": j.placement.cp_size, "rank": j.placement.cp_rank, "tokens": p.shape.tokens,
            "num_pages": p.shape.num_pages, "owned_pages": owned, "num_layers": p.shape.num_layers,
            "kv_page_bytes": p.kv_page_bytes, "indexer_page_bytes": p.idx_page_bytes, "bytes": nbytes,
            "reps": reps, "min_ms": _sig(min(times)), "p50_ms": _sig(p50), "max_ms": _sig(max(times)),
            "per_layer_ms": _sig(p50 / p.shape.num_layers), "gbps": _sig(gbps),
            "ceiling_gbps": _sig(ceilings[direction]),
            "pct_of_ceiling": _sig(100 * gbps / ceilings[direction]) if ceilings[direction] else None,
            "bit_exact": err is None, "error": err,
        })
    return rows


# ----------------------------------------------------------------------------- driver
def git_sha(override: str | None = None) -> str:
    if override:
        return override
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def meta_of(device: torch.device, sha: str | None) -> dict:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "backend": transfer.select_backend(device), "torch": torch.__version__,
            "triton": triton.__version__, "git_sha": git_sha(sha),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def ranks_of(spec: str, cp_size: int) -> list[int]:
    if spec == "all":
        return list(range(cp_size))
    ranks = [int(x) for x in spec.split(",")]
    return [r for r in ranks if r < cp_size]


def run_kv_dtype(args: argparse.Namespace, kv_dtype: str, device: torch.device, shape: Shape, meta: dict,
                 deadline: float, skipped: list[str]) -> list[dict]:
    """Every (host layout, CP size, rank) of one KV dtype on one set of pools,
    freed on return; configurations past ``deadline`` are listed in ``skipped``."""
    rows: list[dict] = []
    pools = make_pools(kv_dtype, shape, device)
    try:
        for host_layout in args.host_layouts:
            for n in args.cp_sizes:
                for r in ranks_of(args.ranks, n):
                    if time.perf_counter() > deadline:
                        skipped.append(f"{kv_dtype}/{host_layout}/cp{n}/rank{r}: time budget spent")
                        continue
                    job = make_job(pools, host_layout, CpPlacement(shape.page_size, n, r), seed=n * 131 + r)
                    rows += measure(job, args.reps, meta)
                    print(summary_line(rows[-2]), summary_line(rows[-1]), sep="\n", flush=True)
    finally:
        close_pools(pools)
    return rows


def run(args: argparse.Namespace, device: torch.device, shape: Shape) -> dict:
    meta = meta_of(device, args.git_sha)
    t0 = time.perf_counter()
    deadline = t0 + args.time_budget_s
    rows: list[dict] = []
    skipped: list[str] = []
    for kv_dtype in args.kv_dtypes:
        if time.perf_counter() > deadline:
            skipped.append(f"{kv_dtype}: time budget spent")
            continue
        rows += run_kv_dtype(args, kv_dtype, device, shape, meta, deadline, skipped)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failures = [f"{r['kv_dtype']}/{r['host_layout']}/cp{r['cp_size']}/rank{r['rank']}/{r['op']}: {r['error']}"
                for r in rows if not r["bit_exact"]]
    return {"meta": meta, "shape": asdict(shape), "seconds": round(time.perf_counter() - t0, 2), "rows": rows,
            "skipped": skipped, "failures": failures, "ok": bool(rows) and not failures}


def summary_line(r: dict) -> str:
    pct = "" if r["pct_of_ceiling"] is None else f" ({r['pct_of_ceiling']}% of {r['ceiling_gbps']} GB/s)"
    return (f"{r['op']:8s} {r['kv_dtype']} {r['host_layout']:17s} cp{r['cp_size']} rank{r['rank']}: "
            f"{r['owned_pages']} of {r['num_pages']} pages x {r['num_layers']} layers, {r['bytes'] / 1e6:.1f} MB, "
            f"{r['p50_ms']:.3f} ms, {r['gbps']:.2f} GB/s{pct}, bit_exact={r['bit_exact']}")


def write(out: dict, out_dir: str, tag: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"restore_{tag}.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(out_dir, f"restore_{tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(out["rows"])


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="small run on CPU tensors (tests this script)")
    ap.add_argument("--out", required=True, help="results directory")
    ap.add_argument("--tokens", type=int, default=None, help="prefix tokens (default 100000; --cpu 2048)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 61; --cpu 4)")
    ap.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=None, help="fp8,bf16 (--cpu: fp8)")
    ap.add_argument("--host-layouts", type=lambda s: s.split(","), default=["layer_first"])
    ap.add_argument("--cp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 8])
    ap.add_argument("--ranks", default="0", help="ranks to run at each CP size: comma list or 'all'")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; --cpu 2)")
    ap.add_argument("--time-budget-s", type=float, default=45.0, help="no new configuration after this")
    ap.add_argument("--git-sha", default=None, help="recorded in the output (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    for name, values, valid in (("--kv-dtypes", args.kv_dtypes or [], KV_DTYPES),
                                ("--host-layouts", args.host_layouts, HOST_LAYOUTS)):
        bad = [v for v in values if v not in valid]
        if bad:
            ap.error(f"{name}: unknown {bad}; valid: {', '.join(valid)}")
    if any(n < 1 for n in args.cp_sizes):
        ap.error(f"--cp-sizes: each must be >= 1, got {args.cp_sizes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("bench_restore: CUDA is not available (--cpu tests this script on a CPU)", file=sys.stderr)
        return 2
    base = CPU_SHAPE if args.cpu else GPU_SHAPE
    shape = Shape(args.tokens or base.tokens, args.layers or base.num_layers, base.page_size)
    args.kv_dtypes = args.kv_dtypes or (["fp8"] if args.cpu else ["fp8", "bf16"])
    args.reps = args.reps or (2 if args.cpu else 5)
    device = torch.device("cpu" if args.cpu else "cuda")
    out = run(args, device, shape)
    write(out, args.out, "cpu" if args.cpu else "gpu")
    print(f"bench_restore: {'OK' if out['ok'] else 'FAILED'} in {out['seconds']}s; {len(out['rows'])} rows; "
          f"skipped: {out['skipped']}; failures: {out['failures']}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
