"""GPU check for SGLang 0.5.23's KV-sharded DSA HiCache: this library's copy
kernels vs upstream's copy path, bitwise and in GB/s, at CP 1, 2 and 8.

Upstream's path is what one rank of a 0.5.23 sharded server runs per
transfer: ``PageInterleaveHostPool.owned_rows`` (a host ``nonzero`` over the
host owner mask plus a device gather of the device locs), the host indices
moved to the device as ``move_indices`` does (or kept on the host where the
pool uses its staged write-back kernel), then SGLang's own host pools --
``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, built by upstream's
``build_host_pool_group`` exactly as its DSA strategy builds them -- run their
kernels (JIT ``transfer_hicache_*`` where SGLang picks them, else
``sgl_kernel`` ``transfer_kv_*``). At CP 1 there is no narrowing (upstream's
unsharded path). The library's path is what
:class:`sglang_cp_hicache.sglang_0523.controller.LibraryCopyController` and
:class:`~sglang_cp_hicache.sglang_0523.copy_engine.LibraryL2TransferEngine`
run: the host mask and local rows on the host, then one fused
mask-and-translate kernel per direction over the LOGICAL device locs.

One process stands for rank 0 of CP N (the device pool holds that rank's
physical pages only; the logical batch mixes every owner, as a sequence's
pages do). Both paths copy between the same buffers:

* bitwise: host bytes after backup, and device bytes after a per-layer load
  into poisoned layers, must be identical between the two paths and equal to
  the source pages, KV and indexer, ``layer_first`` and ``page_first``; every
  rank of each CP size on a small batch;
* GB/s: median of timed repetitions (CUDA events around index preparation +
  copies), owned bytes only, on a large batch at rank 0.

Exit status: 0 all bitwise checks passed, 1 a check failed, 3 not applicable
(SGLang 0.5.23 is not importable here; the JSON says why). ``--device cpu``
runs the same code on CPU tensors with the harness's emulated stock ops
(:mod:`sglang_cp_hicache.testing.cpu_0523`) and small pools, to test this
script without a GPU; its JSON says ``"device": "cpu"`` and is no GPU result.

Usage::

    python bench/gpu_check_0523.py --out DIR            # on the GPU box, ~2 min
    python bench/gpu_check_0523.py --device cpu --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from bench_paths import new_out_path

P = 64  # DSA pages; KV sharding requires 64
POISON = 0xA5
KV_ROW_BYTES = 576  # fp8_e4m3, the TRTLLM latent row KV sharding requires
INDEXER_PAGE_BYTES = 132 * P
CP_SIZES = (1, 2, 8)
HOST_LAYOUTS = ("layer_first", "page_first")
EXIT_NOT_APPLICABLE = 3


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    dev_pages: int  # physical pages of this rank's device pool
    host_pages: int  # this rank's host pages
    check_pages: int  # logical pages per bitwise batch
    bench_pages: int  # logical pages per timed batch
    reps: int


GPU = Geometry(num_layers=4, dev_pages=2304, host_pages=2304, check_pages=37, bench_pages=2048, reps=20)
CPU = Geometry(num_layers=2, dev_pages=40, host_pages=40, check_pages=13, bench_pages=32, reps=3)


# ----------------------------------------------------------------------------- pools
@dataclass
class Pools:
    device: torch.device
    host_layout: str
    kv_pool: Any  # DSATokenToKVPool (this rank's physical pages)
    kv_host: Any  # MLATokenToKVPoolHost
    index_host: Any  # DSAIndexerPoolHost

    def device_buffers(self) -> list[torch.Tensor]:
        return [b.view(torch.uint8) for b in self.kv_pool.kv_buffer] + list(self.kv_pool.index_k_with_scale_buffer)

    def host_buffers(self) -> list[torch.Tensor]:
        return [self.kv_host.kv_buffer.view(torch.uint8), self.index_host.index_k_with_scale_buffer]


def build_pools(device: torch.device, host_layout: str, g: Geometry) -> Pools:
    """Upstream's own pools: a DSA device pool and the host group its DSA
    strategy builds (``prepare_host_pool_config`` + ``build_host_pool_group``)."""
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.host_pool_config import prepare_host_pool_config
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_host_pool_group
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from sglang_cp_hicache.testing import env

    server_args = env.make_cpu_server_args(
        page_size=P, hicache_mem_layout=host_layout, hicache_io_backend="kernel",
        hicache_ratio=(g.host_pages + 0.5) / g.dev_pages, device=device.type,
    )
    env.publish_server_args(server_args)
    runtime_context.get_parallel().override_permanently(attn_dcp_size=1)
    kv_pool = DSATokenToKVPool(
        size=g.dev_pages * P, page_size=P, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
        layer_num=g.num_layers, device=str(device), index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=KV_ROW_BYTES,
    )
    config = prepare_host_pool_config(
        decls=kv_pool.host_pool_decls(), full_layer_mapping={i: i for i in range(g.num_layers)},
        transfer_layer_id_max=g.num_layers, transfer_page_size=P, packed_draft_device_pools=(),
    )
    group = build_host_pool_group(config=config)
    kv_host, index_host = group.anchor_entry.host_pool, group.entry_map[PoolName.INDEXER].host_pool
    if device.type == "cpu":
        from sglang_cp_hicache.testing import cpu_0523

        cpu_0523.register_stack_buffers(group)
    return Pools(device, host_layout, kv_pool, kv_host, index_host)


# ----------------------------------------------------------------------------- batches
@dataclass
class Batch:
    """One transfer as a rank sees it: logical device locs of whole pages
    (every owner) and the logical host slots paired with them (host page
    owner == device page owner, as PageInterleaveHostPool allocates them)."""

    device_locs: torch.Tensor  # on the device
    host_slots: torch.Tensor  # CPU
    owned_device_pages: torch.Tensor  # physical pages of this rank, CPU
    owned_tokens: int


def make_batch(cp_size: int, rank: int, num_pages: int, g: Geometry, gen: torch.Generator, device) -> Batch:
    groups = -(-num_pages // cp_size)
    if groups > min(g.dev_pages, g.host_pages) - 1:
        raise ValueError(f"{num_pages} logical pages at CP {cp_size} do not fit the pools")
    # scattered groups of cp_size consecutive logical pages (one per owner)
    dev_q = torch.randperm(g.dev_pages - 1, generator=gen)[:groups] + 1
    host_q = torch.randperm(g.host_pages - 1, generator=gen)[:groups] + 1
    owners = torch.arange(cp_size)
    dev_pages = (dev_q[:, None] * cp_size + owners).flatten()[:num_pages]
    host_pages = (host_q[:, None] * cp_size + owners).flatten()[:num_pages]
    locs = lambda pages: (pages[:, None] * P + torch.arange(P)).flatten().to(torch.int64)
    owned = dev_pages[dev_pages % cp_size == rank] // cp_size
    return Batch(locs(dev_pages).to(device), locs(host_pages), owned, int(owned.numel()) * P)


# ----------------------------------------------------------------------------- the two paths
def _placement(cp_size: int, rank: int) -> Any:
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec

    spec = PageShardSpec(shard_rank=rank, shard_size=cp_size, page_size=P, max_prefix_tokens=cp_size * P,
                         chunk_tokens=P)
    return PageInterleavePlacement(spec)


def _host_index_for(pool: Any, host_rows: torch.Tensor, device: torch.device, write: bool) -> torch.Tensor:
    # move_indices (kernel io) puts host indices on the device; a write keeps
    # them on the host for a pool that uses its staged write-back kernel.
    if write and getattr(pool, "can_use_write_back_jit", False):
        return host_rows.cpu()
    return host_rows.to(device, non_blocking=True) if device.type != "cpu" else host_rows


def upstream_prepare(batch: Batch, cp_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if cp_size == 1:
        return batch.host_slots, batch.device_locs
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    anchor = SimpleNamespace(placement=_placement(cp_size, rank), shard_rank=rank)
    return PageInterleaveHostPool.owned_rows(anchor, batch.host_slots, batch.device_locs)


def upstream_backup(pools: Pools, batch: Batch, cp_size: int, rank: int) -> None:
    host_rows, device_rows = upstream_prepare(batch, cp_size, rank)
    if host_rows.numel() == 0:
        return
    for pool in (pools.kv_host, pools.index_host):
        rows = _host_index_for(pool, host_rows, pools.device, write=True)
        pool.backup_from_device_all_layer(pools.kv_pool, rows, device_rows, "kernel")


def upstream_load(pools: Pools, batch: Batch, cp_size: int, rank: int) -> None:
    host_rows, device_rows = upstream_prepare(batch, cp_size, rank)
    if host_rows.numel() == 0:
        return
    rows = _host_index_for(pools.kv_host, host_rows, pools.device, write=False)
    for layer in range(pools.kv_pool.layer_num):
        pools.kv_host.load_to_device_per_layer(pools.kv_pool, rows, device_rows, layer, "kernel")
        pools.index_host.load_to_device_per_layer(pools.kv_pool, rows, device_rows, layer, "kernel")


def library_prepare(batch: Batch, cp_size: int, rank: int, device: torch.device) -> torch.Tensor:
    placement = _placement(cp_size, rank)
    host = batch.host_slots
    rows = placement.local_index(host[placement.local_mask(host, rank)])
    return rows.to(device, non_blocking=True) if device.type != "cpu" else rows


def library_backup(pools: Pools, batch: Batch, cp_size: int, rank: int) -> None:
    from sglang_cp_hicache.kernels import transfer
    from sglang_cp_hicache.placement import CpPlacement

    placement = CpPlacement(P, cp_size, rank)
    rows = library_prepare(batch, cp_size, rank, pools.device)
    transfer.backup_kv_all_layers(pools.kv_host.device_kv_buffers, pools.kv_host.kv_buffer, pools.host_layout,
                                  batch.device_locs, rows, placement)
    transfer.backup_indexer_all_layers(pools.index_host.packed_device_index_buffers,
                                       pools.index_host.index_k_with_scale_buffer, pools.host_layout,
                                       batch.device_locs, rows, placement)


def library_load(pools: Pools, batch: Batch, cp_size: int, rank: int) -> None:
    from sglang_cp_hicache.kernels import transfer
    from sglang_cp_hicache.placement import CpPlacement

    placement = CpPlacement(P, cp_size, rank)
    rows = library_prepare(batch, cp_size, rank, pools.device)
    for layer in range(pools.kv_pool.layer_num):
        transfer.load_kv_one_layer(pools.kv_host.device_kv_buffers[layer], pools.kv_host.kv_buffer,
                                   pools.host_layout, layer, batch.device_locs, rows, placement)
        transfer.load_indexer_one_layer(pools.kv_pool.index_k_with_scale_buffer[layer],
                                        pools.index_host.index_k_with_scale_buffer, pools.host_layout, layer,
                                        batch.device_locs, rows, placement)


PATHS: dict[str, tuple[Callable, Callable]] = {
    "upstream": (upstream_backup, upstream_load),
    "library": (library_backup, library_load),
}


# ----------------------------------------------------------------------------- checks
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill_random(buffers: list[torch.Tensor], gen: torch.Generator) -> None:
    for b in buffers:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).to(b.device))


def bitwise_case(pools: Pools, cp_size: int, rank: int, g: Geometry, seed: int) -> list[str]:
    """Problems found (empty: identical and exact)."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(cp_size, rank, g.check_pages, g, gen, pools.device)
    _fill_random(pools.device_buffers(), gen)
    source = [b.clone() for b in pools.device_buffers()]
    problems, host_after, device_after = [], {}, {}
    for name, (backup, load) in PATHS.items():
        for b in pools.host_buffers():
            b.fill_(POISON)
        for b, s in zip(pools.device_buffers(), source):
            b.copy_(s)
        backup(pools, batch, cp_size, rank)
        _sync(pools.device)
        host_after[name] = [b.clone() for b in pools.host_buffers()]
        for b in pools.device_buffers():
            b.fill_(POISON)
        load(pools, batch, cp_size, rank)
        _sync(pools.device)
        device_after[name] = [b.clone() for b in pools.device_buffers()]
    for what, after in (("host after backup", host_after), ("device after load", device_after)):
        for i, (a, b) in enumerate(zip(after["upstream"], after["library"])):
            if not torch.equal(a, b):
                problems.append(f"{what}: buffer {i} differs between upstream and library "
                                f"({int((a != b).sum())} bytes)")
    # every owned page restored to its source bytes, nothing else written
    owned = batch.owned_device_pages.to(pools.device)
    for i, (restored, src) in enumerate(zip(device_after["library"], source)):
        is_kv = i < pools.kv_pool.layer_num
        rows = (owned[:, None] * P + torch.arange(P, device=pools.device)).flatten() if is_kv else owned
        if not torch.equal(restored[rows], src[rows]):
            problems.append(f"device buffer {i}: owned pages not restored to their source bytes")
        keep = torch.ones(restored.shape[0], dtype=torch.bool, device=pools.device)
        keep[rows] = False
        if not bool((restored[keep] == POISON).all()):
            problems.append(f"device buffer {i}: bytes written outside the owned pages")
    return problems


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    def cuda_ms(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def cpu_ms(fn: Callable[[], None]) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cuda_ms if device.type == "cuda" else cpu_ms


def bandwidth_case(pools: Pools, cp_size: int, g: Geometry, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(cp_size, 0, g.bench_pages, g, gen, pools.device)
    owned_pages = batch.owned_tokens // P
    layers = pools.kv_pool.layer_num
    nbytes = owned_pages * layers * (P * KV_ROW_BYTES + INDEXER_PAGE_BYTES)
    timer = _timer(pools.device)
    out: dict[str, Any] = {"cp_size": cp_size, "logical_pages": g.bench_pages, "owned_pages": owned_pages,
                           "layers": layers, "bytes": nbytes}
    for name, (backup, load) in PATHS.items():
        for direction, fn in (("d2h", backup), ("h2d", load)):
            call = lambda: fn(pools, batch, cp_size, 0)
            for _ in range(3):
                call()
            _sync(pools.device)
            ms = statistics.median(timer(call) for _ in range(g.reps))
            out[f"{name}_{direction}_ms"] = ms
            out[f"{name}_{direction}_gbps"] = nbytes / ms / 1e6 if ms > 0 else None
    for direction in ("d2h", "h2d"):
        up, lib = out[f"upstream_{direction}_ms"], out[f"library_{direction}_ms"]
        out[f"speedup_{direction}"] = up / lib if lib > 0 else None
    return out


# ----------------------------------------------------------------------------- main
def _env(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # recorded, not fatal here
        info["triton"] = f"unavailable: {exc}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _import_sglang(device: torch.device) -> str | None:
    """None when SGLang 0.5.23's cache code imports, else why not."""
    try:
        if device.type == "cpu":
            from sglang_cp_hicache.testing import cpu_0523

            cpu_0523.install_cpu_support()
        else:
            from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

            ensure_sglang_importable()
        import sglang
        from sglang.srt.mem_cache.pool_host import mla  # noqa: F401  (stock kernels under CUDA)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if sglang.__version__ != "0.5.23":
        return f"sglang {sglang.__version__} installed, this check is for 0.5.23"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None,
                    help="results directory (default: a new build/bench-results/gpu_check_0523_<UTC time>)")
    ap.add_argument("--cp-sizes", default=",".join(map(str, CP_SIZES)))
    args = ap.parse_args(argv)
    args.out = args.out or new_out_path("gpu_check_0523")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs CUDA")
    cp_sizes = [int(x) for x in args.cp_sizes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check_0523.json")
    g = GPU if device.type == "cuda" else CPU
    report: dict[str, Any] = {"env": _env(device), "geometry": asdict(g), "gpu_result": device.type == "cuda"}
    why = _import_sglang(device)
    if why is not None:
        report["not_applicable"] = why
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"gpu_check_0523: not applicable ({why})")
        return EXIT_NOT_APPLICABLE
    import sglang

    report["env"]["sglang"] = sglang.__version__
    from sglang_cp_hicache.kernels import transfer

    report["env"]["library_backend"] = transfer.select_backend(device)
    failures: list[str] = []
    report["bitwise"], report["bandwidth"] = [], []
    for host_layout in HOST_LAYOUTS:
        try:
            pools = build_pools(device, host_layout, g)
        except Exception:
            failures.append(f"{host_layout}: building upstream's pools failed")
            report["bitwise"].append({"host_layout": host_layout, "error": traceback.format_exc()})
            continue
        report.setdefault("upstream_kernels", {})[host_layout] = {
            "kv_jit": bool(getattr(pools.kv_host, "can_use_jit", False)),
            "kv_write_back_jit": bool(getattr(pools.kv_host, "can_use_write_back_jit", False)),
            "indexer_write_back_jit": bool(getattr(pools.index_host, "can_use_write_back_jit", False)),
        }
        for cp_size in cp_sizes:
            for rank in range(cp_size):
                case = {"host_layout": host_layout, "cp_size": cp_size, "rank": rank}
                try:
                    case["problems"] = bitwise_case(pools, cp_size, rank, g, seed=1000 * cp_size + rank)
                except Exception:
                    case["problems"] = [f"raised: {traceback.format_exc()}"]
                failures += [f"{host_layout} cp{cp_size} rank{rank}: {p}" for p in case["problems"]]
                report["bitwise"].append(case)
            try:
                report["bandwidth"].append({"host_layout": host_layout, **bandwidth_case(pools, cp_size, g, seed=7)})
            except Exception:
                failures.append(f"{host_layout} cp{cp_size}: bandwidth run raised")
                report["bandwidth"].append({"host_layout": host_layout, "cp_size": cp_size,
                                            "error": traceback.format_exc()})
        del pools
    report["failures"] = failures
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    for row in report["bandwidth"]:
        if "error" not in row:
            print(f"gpu_check_0523 {row['host_layout']:<11} cp{row['cp_size']}: "
                  f"d2h upstream {row['upstream_d2h_gbps']:.1f} / library {row['library_d2h_gbps']:.1f} GB/s, "
                  f"h2d upstream {row['upstream_h2d_gbps']:.1f} / library {row['library_h2d_gbps']:.1f} GB/s")
    print(f"gpu_check_0523: {'FAIL' if failures else 'ok'} ({len(report['bitwise'])} bitwise cases, "
          f"{len(failures)} problems, device {device.type}) -> {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
