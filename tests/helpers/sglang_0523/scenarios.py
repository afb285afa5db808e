"""What each rank process runs (through :func:`tests.helpers.sglang_0523.ranks.run_ranks`).

Every function builds real SGLang 0.5.23 sharded stacks on this rank, drives
them, compares in-process and returns plain data (it crosses a process
boundary). The two copy paths are built side by side in one process and
driven with identical requests, so every decision (locs, host slots, owners)
is the same and the bytes can be compared buffer to buffer.
"""

from __future__ import annotations

from typing import Any

# Requests (token ids) of the round trip: A new chain (5 pages + a partial
# page), B extends A by 3 pages, C a second chain, F a filler chain that
# takes the freed pages so the load-backs land on other device pages.
P = 64
_A = list(range(5000, 5000 + 5 * P + 17))
_B = _A[: 5 * P] + list(range(9000, 9000 + 3 * P))
_C = list(range(20000, 20000 + 3 * P))
_F = list(range(30000, 30000 + 2 * P))


class _LogLines:
    """INFO lines logged under ``name`` while open."""

    def __init__(self, name: str) -> None:
        import logging

        self.lines: list[str] = []
        self.logger = logging.getLogger(name)
        self.level = self.logger.level
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def _setup() -> None:
    from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

    ensure_sglang_importable()
    import logging

    logging.getLogger("sglang").setLevel(logging.ERROR)


def _bytes(t: Any) -> Any:
    import torch

    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _host_buffers(stack: Any) -> list[Any]:
    return [_bytes(stack.kv_host.host_pool.kv_buffer), _bytes(stack.index_host.index_k_with_scale_buffer)]


def _device_buffers(stack: Any) -> list[Any]:
    return [_bytes(b) for b in stack.kv_pool.kv_buffer] + list(stack.kv_pool.index_k_with_scale_buffer)


def _nodes(stack: Any) -> dict[tuple, tuple]:
    """token key -> (logical device locs or None, logical host slots or None)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    out, todo = {}, [stack.cache.tree_core.root_node]
    while todo:
        node = todo.pop()
        for child in node.children.values():
            data = child.component(ComponentType.FULL)
            out[tuple(child.key.token_ids)] = (
                None if data.value is None else data.value.clone(),
                None if data.host_value is None else data.host_value.clone(),
            )
            todo.append(child)
    return out


def _drive(stack: Any) -> dict[str, Any]:
    """The round trip on one stack; returns snapshots and per-request records."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.content import poison_device
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    for buf in _host_buffers(stack):
        buf.fill_(0x5A)  # unwritten host bytes must compare equal across paths
    poison_device(stack.kv_pool)
    engine = ShardedSimRankEngine(stack, content_seed=3)
    records = [engine.serve(i, tokens) for i, tokens in enumerate((_A, _B, _C))]
    backed_up = _nodes(stack)
    paths_backed_up = {name: _path_locs(stack, t) for name, t in (("B", _B), ("C", _C))}
    host_after_backup = [b.clone() for b in _host_buffers(stack)]
    evicted = stack.cache.evict(EvictParams(num_tokens=stack.allocator.size)).num_tokens_evicted
    poison_device(stack.kv_pool)
    records += [engine.serve(3 + i, tokens) for i, tokens in enumerate((_F, _B, _C))]
    return {
        "engine": engine,
        "records": records,
        "backed_up": backed_up,
        "restored": _nodes(stack),
        "paths_backed_up": paths_backed_up,
        "paths_restored": {name: _path_locs(stack, t) for name, t in (("B", _B), ("C", _C))},
        "host_after_backup": host_after_backup,
        "device_after_restore": [b.clone() for b in _device_buffers(stack)],
        "evicted": int(evicted),
        "totals": engine.totals(),
        "counters": getattr(stack.controller.l2_transfer_engine, "counters", None),
    }


def _owners(placement: Any, locs: Any) -> list[int]:
    import torch

    return placement.owner_of(locs[::P].to(torch.int64).cpu()).tolist()


def _path_locs(stack: Any, tokens: list[int]) -> dict[str, Any]:
    """Logical device locs and host slots along the tree path of ``tokens``
    (whole pages), concatenated; None where a node on the path lacks them."""
    import torch
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    node, pos, device, host = stack.cache.tree_core.root_node, 0, [], []
    while True:
        nxt = next(
            (c for c in node.children.values()
             if list(c.key.token_ids) == tokens[pos : pos + len(c.key.token_ids)]),
            None,
        )
        if nxt is None:
            break
        data = nxt.component(ComponentType.FULL)
        device.append(data.value)
        host.append(data.host_value)
        node, pos = nxt, pos + len(nxt.key.token_ids)

    def cat(parts: list) -> Any:
        return None if not parts or any(p is None for p in parts) else torch.cat(parts).to(torch.int64).cpu()

    return {"tokens": pos, "device": cat(device), "host": cat(host)}


def _same_nodes(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in zip(a[k], b[k]))
        for k in a
    )


def _pool_facts(stack: Any) -> dict[str, Any]:
    """What the warm-up must be given, read off the device pool and config."""
    kv_layer, index_layer = stack.kv_pool.kv_buffer[0], stack.kv_pool.index_k_with_scale_buffer[0]
    return {
        "page_size": stack.config.page_size, "host_layout": stack.config.host_layout,
        "num_layers": stack.config.num_layers, "kv_dim": int(kv_layer.shape[-1]), "kv_dtype": str(kv_layer.dtype),
        "indexer_page_bytes": int(index_layer.shape[-1]), "device": str(kv_layer.device),
    }


def _recording_warmups() -> tuple[list, Any]:
    """Record every ``kernels.transfer.warmup`` call (and let it run)."""
    from sglang_cp_hicache.kernels import transfer

    calls: list[dict[str, Any]] = []
    real = transfer.warmup

    def recorded(**kwargs: Any) -> Any:
        calls.append({k: str(v) if k in ("kv_dtype", "device") else v for k, v in kwargs.items()})
        return real(**kwargs)

    transfer.warmup = recorded
    return calls, real


def differential(rank: int, world: int, *, layouts: tuple[str, ...]) -> dict[str, Any]:
    """Upstream vs library on identical requests, per host layout."""
    _setup()
    import torch
    import torch.distributed as dist

    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    out: dict[str, Any] = {"backend": None}
    for host_layout in layouts:
        runs = {}
        for copy_path in ("upstream", "library"):
            config = ShardedStackConfig(
                cp_size=world, device_pages=10, host_pages=24, host_layout=host_layout, copy_path=copy_path
            )
            calls, real_warmup = _recording_warmups()
            logs = _LogLines("sglang_cp_hicache.sglang_0523")
            try:
                stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
            finally:
                from sglang_cp_hicache.kernels import transfer as _transfer

                _transfer.warmup = real_warmup
                logs.close()
            warmup = stack.cp.warmup if copy_path == "library" else None
            out.setdefault("warmups", {})[f"{host_layout}/{copy_path}"] = {
                "calls": calls, "pools": _pool_facts(stack), "log": logs.lines,
                "report": None if warmup is None else warmup.as_dict(),
            }
            runs[copy_path] = (stack, _drive(stack))
        (up_stack, up), (lib_stack, lib) = runs["upstream"], runs["library"]
        placement = up_stack.placement
        from sglang_cp_hicache.kernels import transfer

        out["backend"] = transfer.select_backend(lib_stack.kv_pool.kv_buffer[0].device)

        host_owner_mismatch = [
            (len(key), _owners(placement, dev), _owners(placement, host))
            for run in (up, lib)
            for key, (dev, host) in run["backed_up"].items()
            if dev is not None and host is not None and _owners(placement, dev) != _owners(placement, host)
        ]
        per_path = {}
        for name, run in (("upstream", up), ("library", lib)):
            recs = run["records"]
            per_path[name] = {
                "loaded_tokens": [r.loaded_tokens for r in recs],
                "host_hit_tokens": [r.host_hit_tokens for r in recs],
                "restored_pages_verified": sum(r.restored_pages_verified for r in recs),
                "verified_pages": sum(r.verified_pages for r in recs),
                "corrupted_pages": sum(r.corrupted_pages for r in recs),
                "invariant_violations": run["totals"].invariant_violations,
                "backup_slots": run["totals"].backup_slots,
                "load_slots": run["totals"].load_slots,
                "evicted": run["evicted"],
                "digest": run["totals"].tree_digest,
            }
        counters = lib["counters"]
        out[host_layout] = {
            "per_path": per_path,
            "same_backed_up_nodes": _same_nodes(up["backed_up"], lib["backed_up"]),
            "same_restored_nodes": _same_nodes(up["restored"], lib["restored"]),
            "host_bytes_equal": [torch.equal(a, b) for a, b in zip(up["host_after_backup"], lib["host_after_backup"])],
            "device_bytes_equal": [
                torch.equal(a, b) for a, b in zip(up["device_after_restore"], lib["device_after_restore"])
            ],
            "host_owner_mismatch": host_owner_mismatch,
            "paths": {
                name: {
                    req: {
                        "backup_tokens": run["paths_backed_up"][req]["tokens"],
                        "restored_tokens": run["paths_restored"][req]["tokens"],
                        "backup_device_owners": _owners(placement, run["paths_backed_up"][req]["device"]),
                        "backup_host_owners": _owners(placement, run["paths_backed_up"][req]["host"]),
                        "restored_device_owners": _owners(placement, run["paths_restored"][req]["device"]),
                        "moved": not torch.equal(
                            run["paths_backed_up"][req]["device"], run["paths_restored"][req]["device"]
                        ),
                    }
                    for req in ("B", "C")
                }
                for name, run in (("upstream", up), ("library", lib))
            },
            "library_counters": None if counters is None else vars(counters),
        }
        for stack, _ in runs.values():
            stack.close()
    return out


def _sim_summary(engine: Any, records: list) -> dict[str, Any]:
    totals = engine.totals()
    return {
        "records": [
            (r.device_hit_tokens, r.host_hit_tokens, r.loaded_tokens, r.new_tokens, r.skipped) for r in records
        ],
        "verified_pages": sum(r.verified_pages for r in records),
        "restored_pages_verified": sum(r.restored_pages_verified for r in records),
        "corrupted_pages": sum(r.corrupted_pages for r in records),
        "indexer_pages_verified": engine.indexer_pages_verified,
        "acks": list(engine.acks.as_tuple()),
        "digest": totals.tree_digest,
        "invariant_violations": totals.invariant_violations,
        "load_backs": totals.load_backs,
        "host_evicted_nodes": totals.host_evicted_nodes,
        "copy_seconds": engine.copy_times.total_seconds,
        "copy_calls": engine.copy_times.submit_calls,
    }


#: Simulator runs: name -> (copy path, host pages per rank). With 96 host
#: pages the workload never evicts from the host, so both paths take the same
#: decisions and only the copies differ; with 8 both evict host pages,
#: upstream's host eviction loses backups (finding 1) and the library's
#: owner-aware host room does not (and evicts only what a backup needs), so
#: the trees differ. The corrupt run flips a byte in the first restored page.
SIM_RUNS = {
    "upstream": ("upstream", 96),
    "library": ("library", 96),
    "upstream-tight": ("upstream", 8),
    "library-tight": ("library", 8),
    "library-corrupt": ("library", 8),
}


def _count_backup_failures(cache: Any) -> list[int]:
    """[backups made, backups that returned no host slots], counted at
    ``_execute_kv_backup`` (upstream may give up before it calls write)."""
    counts = [0, 0]
    backup = cache._execute_kv_backup

    def counted(*args: Any) -> Any:
        out = backup(*args)
        counts[out is None] += 1
        return out

    cache._execute_kv_backup = counted
    return counts


def simulate_both_paths(rank: int, world: int, *, num_requests: int) -> dict[str, Any]:
    """The simulator's workload on both copy paths (:data:`SIM_RUNS`), in
    this one process."""
    _setup()
    import torch.distributed as dist

    from sglang_cp_hicache.kernels import transfer
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    from sglang_cp_hicache.sim.workload import synthetic_chat
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    out: dict[str, Any] = {}
    requests = None
    for name, (copy_path, host_pages) in SIM_RUNS.items():
        config = ShardedStackConfig(cp_size=world, device_pages=8, host_pages=host_pages, copy_path=copy_path)
        if requests is None:
            requests = synthetic_chat(num_requests, seed=5, max_tokens=(config.logical_pages - 1) * P)
        stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
        engine = ShardedSimRankEngine(stack, content_seed=1)
        backups = _count_backup_failures(stack.cache)
        stats_before = transfer.copy_stats()
        records = []
        for i, request in enumerate(requests):
            if name.endswith("corrupt") and records and records[-1].loaded_tokens == 0:
                engine.corrupt_next_restore = True
                engine.corrupt_part = "indexer" if rank % 2 else "kv"
            records.append(engine.serve(i, request.tokens))
        stats = transfer.copy_stats()
        out[name] = _sim_summary(engine, records)
        out[name]["backups"], out[name]["backup_failures"] = backups
        out[name]["library_kernel_calls"] = (
            stats.kv_backup_calls + stats.kv_load_calls + stats.indexer_backup_calls + stats.indexer_load_calls
            - stats_before.kv_backup_calls - stats_before.kv_load_calls
            - stats_before.indexer_backup_calls - stats_before.indexer_load_calls
        )
        stack.close()
    return out


def refusals(rank: int, world: int) -> dict[str, str]:
    """Each seam knocked out in turn: building the library stack must refuse,
    naming what did not take."""
    _setup()
    import torch.distributed as dist
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    from sglang_cp_hicache.sglang_0523.copy_engine import LibraryL2TransferEngine
    from sglang_cp_hicache.sglang_0523.strategy import LibraryStackError
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    def bypass_shard_indices(self: Any, operation: Any, *, write_back_jit: bool = False) -> Any:
        # An upstream that prepares sharded transfers elsewhere (renamed method).
        return self.move_indices(operation.host_indices, operation.device_indices) + (None,)

    knockouts = {
        "prepare": (HybridCacheController, "move_hybrid_indices", bypass_shard_indices),
        "d2h": (LibraryL2TransferEngine, "submit_device_to_host", L2TransferEngine.submit_device_to_host),
        "h2d": (LibraryL2TransferEngine, "submit_host_to_device", L2TransferEngine.submit_host_to_device),
    }
    out: dict[str, str] = {}
    for name, (owner, attr, replacement) in knockouts.items():
        original = owner.__dict__[attr]
        setattr(owner, attr, replacement)
        try:
            stack = build_sharded_rank_stack(
                ShardedStackConfig(cp_size=world, copy_path="library"), rank, cp_group=dist.group.WORLD
            )
            stack.close()
            out[name] = "built"
        except LibraryStackError as exc:
            out[name] = str(exc)
        finally:
            setattr(owner, attr, original)
    # With every seam in place the same build succeeds.
    stack = build_sharded_rank_stack(ShardedStackConfig(cp_size=world, copy_path="library"), rank,
                                     cp_group=dist.group.WORLD)
    out["intact"] = type(stack.controller).__name__
    stack.close()
    return out


#: Start-up agreement cases: what the LAST rank is started with differently
#: (config overrides, environment, or another rank's cp_rank).
AGREEMENT_CASES: dict[str, dict[str, Any]] = {
    "agree": {},
    "host_layout": {"config": {"host_layout": "page_first"}},
    "host_pages": {"config": {"host_pages": 20}},
    "device_pages": {"config": {"device_pages": 10}},
    "kernel_backend": {"env": {"TRITON_INTERPRET": "0"}},
    "settings": {"env": {"SGLANG_CP_HICACHE_DEBUG": "maybe"}},
    "duplicate_rank": {"cp_rank": 0},
    "settings_on_every_rank": {"env": {"SGLANG_CP_HICACHE_DEBUG": "maybe"}, "every_rank": True},
    # SGLANG_CP_HICACHE_COPY=upstream on the last rank: the plugin's upstream strategy joins the agreement
    "copy_path": {"config": {"copy_path": "upstream", "upstream_via_plugin": True}},
    "upstream_on_every_rank": {"config": {"copy_path": "upstream", "upstream_via_plugin": True}, "every_rank": True},
}


def agreement(rank: int, world: int) -> dict[str, Any]:
    """Build the library stack once per case on every rank; returns case ->
    ("built" or the error) and the number of all-gathers the build made."""
    _setup()
    import torch.distributed as dist

    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack
    from tests.helpers.sglang_0523.ranks import _environ

    gathers = 0
    real_gather = dist.all_gather_object

    def counting_gather(*args: Any, **kwargs: Any) -> Any:
        nonlocal gathers
        gathers += 1
        return real_gather(*args, **kwargs)

    dist.all_gather_object = counting_gather
    out: dict[str, Any] = {}
    try:
        for case, spec in AGREEMENT_CASES.items():
            odd = rank == world - 1 or spec.get("every_rank", False)
            fields = {"cp_size": world, "copy_path": "library", **(spec.get("config", {}) if odd else {})}
            config = ShardedStackConfig(**fields)
            gathers = 0
            try:
                with _environ(spec.get("env", {}) if odd else {}):
                    stack = build_sharded_rank_stack(
                        config, spec.get("cp_rank", rank) if odd else rank, cp_group=dist.group.WORLD
                    )
                    stack.close()
                    out[case] = ("built", gathers)
            except ValueError as exc:  # CpAgreementError or a settings error
                out[case] = (f"{type(exc).__name__}: {exc}", gathers)
    finally:
        dist.all_gather_object = real_gather
    return out


def two_rank_suite(rank: int, world: int, *, num_requests: int) -> dict[str, Any]:
    """Everything the two-rank tests need, in one launch (start-up dominates)."""
    from tests.helpers.sglang_0523.scenarios_bookkeeping import finding_host_eviction, no_sync, upstream_untouched

    return {
        "finding_host_eviction_library": finding_host_eviction(rank, world, copy_path="library"),
        "no_sync": no_sync(rank, world),
        "upstream_untouched": upstream_untouched(rank, world),
        "differential": differential(rank, world, layouts=("layer_first", "page_first")),
        "sim": simulate_both_paths(rank, world, num_requests=num_requests),
        "refusals": refusals(rank, world),
        "finding_host_eviction": finding_host_eviction(rank, world),
        "agreement": agreement(rank, world),
    }
