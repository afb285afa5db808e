"""Rank scenarios for the library's bookkeeping on the sharded stack (run
through :func:`tests.helpers.sglang_0523.ranks.run_ranks`, from
``scenarios.two_rank_suite``): no host read of device locs on the write,
eviction and load-back paths; upstream's stack built untouched by the
plugin's upstream strategy; upstream's lost backups (finding 1) and the
library's owner-aware host room on the same requests."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from array import array
from typing import Any, Callable, Optional

from sglang_cp_hicache.testing.requests_0523 import LoadBackRequest

P = 64


class _Driver:
    """One rank's prefill flow on a sharded stack (whole pages only, so no
    unaligned tail is freed), with the content fill and check -- the forward
    pass's work -- as device work."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.cache, self.allocator = stack, stack.cache, stack.allocator
        self.placement = stack.placement
        self.verified = self.corrupted = self.host_hits = self.loaded = 0
        self.served = 0  # requests served to their end

    def _content(self, locs: Any, start: int, *, check: bool) -> None:
        import torch

        from sglang_cp_hicache.testing.content import corrupted_token_mask, write_content
        from tests.helpers.device_index import device_side, unwrap

        with device_side():
            locs = unwrap(locs).to(torch.int64)
            keys = torch.arange(start, start + locs.numel(), dtype=torch.int64)
            mask = self.placement.owned_by_this_rank(locs)
            phys = self.placement.logical_locs_to_physical(locs[mask])
            if check:
                bad = corrupted_token_mask(self.stack.kv_pool, phys, keys[mask], seed=7)
                self.verified += int(mask.sum()) // P
                self.corrupted += int(bad.any())
            else:
                write_content(self.stack.kv_pool, phys, keys[mask], seed=7)

    def serve(self, index: int, tokens: list[int]) -> None:
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache
        from sglang.srt.mem_cache.radix_cache import RadixKey

        cache, n = self.cache, self.placement.cp_size
        key = RadixKey(array("q", tokens))
        match = cache.match_prefix(MatchPrefixParams(key=key))
        admission = cache.lock(match.last_device_node)
        evict_from_tree_cache(cache, len(tokens) - int(match.device_prefix_len) + P * n)  # device eviction
        last = match.last_device_node
        if match.host_hit_length > 0:  # load-back
            self.host_hits += int(match.host_hit_length)
            base = cache.rotation_base_of(match.best_match_node)
            request = LoadBackRequest(f"r{index}", match.last_device_node, base)
            loaded, last = cache.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=int(match.host_hit_length), req=request,
            ))
            self.loaded += int(loaded)
            cache.ready_to_load_host_cache()
        lock = cache.lock(last)
        cache.unlock(admission)
        prefix = cache.path_device_indices(last)
        self._content(prefix, tokens[0], check=True)
        if prefix.numel() < len(tokens):
            evict_from_tree_cache(cache, len(tokens) - prefix.numel() + P * n)
            base = cache.rotation_base_of(last) if prefix.numel() else None
            lens = torch.tensor([prefix.numel(), len(tokens)], dtype=torch.int64)
            bases = [base]
            new = self.allocator.alloc_extend(
                prefix_lens=lens[:1], prefix_lens_cpu=lens[:1], seq_lens=lens[1:], seq_lens_cpu=lens[1:],
                last_loc=torch.tensor([-1]), extend_num_tokens=len(tokens) - prefix.numel(), rotation_bases=bases,
            )
            self._content(new, tokens[0] + prefix.numel(), check=False)
            cache.insert(InsertParams(  # write-through
                key=key, value=torch.cat([prefix, new]).clone(), rotation_base=bases[0],
                prev_prefix_len=prefix.numel(),
            ))
        cache.unlock(lock)
        cache.check_hicache_events()
        self.served += 1


def _chains() -> list[list[int]]:
    """Write-through of every chain; d pushes a, b, c off the device (device
    eviction) and a, b off the host (host eviction); c and d come back from
    the host (load-back)."""
    a = list(range(1000, 1000 + 5 * P))
    b = a + list(range(2000, 2000 + 3 * P))
    c = list(range(3000, 3000 + 4 * P))
    d = list(range(4000, 4000 + 6 * P))
    return [a, b, c, d, c, d, b, c]


def _watch_reads(stack: Any) -> None:
    """Wrap every device loc the allocator hands out and holds."""
    from tests.helpers.device_index import wrap

    alloc = stack.allocator
    alloc.class_free_pages = [wrap(t) for t in alloc.class_free_pages]
    alloc.class_release_pages = [wrap(t) for t in alloc.class_release_pages]
    alloc_extend = alloc.alloc_extend

    def wrapped_alloc_extend(*args: Any, **kwargs: Any) -> Any:
        return wrap(alloc_extend(*args, **kwargs))

    alloc.alloc_extend = wrapped_alloc_extend


def _as_device_work(fn: Any) -> Any:
    from tests.helpers.device_index import device_side, unwrap

    def on_device(*args: Any, **kwargs: Any) -> Any:
        with device_side():
            return fn(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})

    return on_device


def _kernels_are_device_work() -> list[tuple[Any, str, Any]]:
    """The copy kernels read locs on the device: the library's bound copies
    and the harness's stand-ins for upstream's ``sgl_kernel`` ops run as
    device work. Returns what to restore."""
    import importlib

    from sglang_cp_hicache.kernels.bound import PoolCopies
    from sglang_cp_hicache.testing.cpu_0523 import TRANSFER_OPS

    targets = [(PoolCopies, "backup"), (PoolCopies, "load")]
    for module in ("sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.pool_host.dsa"):
        mod = importlib.import_module(module)
        targets += [(mod, name) for name in TRANSFER_OPS if hasattr(mod, name)]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, fn in saved:
        setattr(owner, name, _as_device_work(fn))
    return saved


def on_both_paths(rank: int, world: int, shape: dict[str, int], run: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``run(stack)`` on this rank's library stack, then its upstream stack,
    of ``shape`` (device and host pages), each stack's device locs raising on
    any host read and the copy kernels as device work (from the first build
    on, once the harness's ops are in place; restored after); each path's
    report. A stack whose run stopped at a host read (its report's
    ``first_read``) is left as it is: the rank process ends after."""
    import torch.distributed as dist

    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack
    from tests.helpers.device_index import DeviceIndex

    saved: list[tuple[Any, str, Any]] = []
    out: dict[str, Any] = {}
    try:
        for path in ("library", "upstream"):
            config = ShardedStackConfig(cp_size=world, copy_path=path, **shape)
            stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
            saved[:] = saved or _kernels_are_device_work()
            _watch_reads(stack)
            DeviceIndex.reads.clear()
            out[path] = run(stack)
            if out[path]["first_read"] is None:
                stack.close()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return out


def first_host_read(serve: Callable[[], Any]) -> Optional[list[str]]:
    """Run ``serve()``; None when it returned, else where the :class:`HostRead`
    that stopped it was raised: the last four frames in SGLang or the library."""
    from tests.helpers.device_index import HostRead

    try:
        serve()
    except HostRead:
        frames = traceback.extract_tb(sys.exc_info()[2])
        return [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames
                if "sglang/" in f.filename or "sglang_cp_hicache/" in f.filename][-4:]
    return None


def path_report(stack: Any, served: int, first_read: Optional[list[str]], counts: Any) -> dict[str, Any]:
    """One copy path's result: what was served, the host reads refused, the
    content checks (``counts``: verified, corrupted, host_hits, loaded) and,
    for the library's stack, its device-free and host-room counters."""
    from tests.helpers.device_index import DeviceIndex

    out = {
        "served": served, "reads": list(DeviceIndex.reads), "first_read": first_read,
        "verified_pages": counts.verified, "corrupted_pages": counts.corrupted,
        "host_hits": counts.host_hits, "loaded": counts.loaded,
    }
    if stack.config.copy_path == "library":
        out.update(device_frees=vars(stack.cp.device_frees.counters), host_room=vars(stack.cp.host_room.counters))
    return out


def no_sync(rank: int, world: int) -> dict[str, Any]:
    """The chains on a library stack whose device locs raise on any host
    read; then on upstream's stack, where the first read is reported."""
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()

    def run(stack: Any) -> dict[str, Any]:
        driver = _Driver(stack)
        first_read = first_host_read(lambda: [driver.serve(i, tokens) for i, tokens in enumerate(_chains())])
        report = path_report(stack, driver.served, first_read, driver)
        if stack.config.copy_path == "library":
            report.update(copies=vars(stack.controller.l2_transfer_engine.counters))
        return report

    return on_both_paths(rank, world, {"device_pages": 6, "host_pages": 8}, run)


# ---- upstream's stack through the plugin's upstream strategy -----------------------------


def _replaced_on_instances(stack: Any) -> list[str]:
    """The library's instance replacements found on ``stack``."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    full = stack.cache.components[ComponentType.FULL]
    where = {
        "cache._execute_kv_backup": (stack.cache, "_execute_kv_backup"),
        "full.evict_component": (full, "evict_component"),
        "allocator.free": (stack.allocator, "free"),
        "allocator.free_segment": (stack.allocator, "free_segment"),
        "allocator.free_group_end": (stack.allocator, "free_group_end"),
        "cache.insert": (stack.cache, "insert"),
        "cache.claim_kv_row": (stack.cache, "claim_kv_row"),
        "cache.free_kv_row": (stack.cache, "free_kv_row"),
        "cache.on_release": (stack.cache, "on_release"),
    }
    return [label for label, (obj, name) in where.items() if name in vars(obj)]


def _attribute_names(stack: Any) -> dict[str, list[str]]:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    objs = {
        "cache": stack.cache, "controller": stack.controller, "engine": stack.controller.l2_transfer_engine,
        "host_group": stack.host_group, "allocator": stack.allocator,
        "full": stack.cache.components[ComponentType.FULL], "tree_core": stack.cache.tree_core,
    }
    return {name: sorted(vars(obj)) for name, obj in objs.items()}


@contextlib.contextmanager
def _start_up_lines():
    """The INFO lines the adapter's strategies log while a stack is built."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("sglang_cp_hicache.sglang_0523.strategy")
    handler, level = Keep(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def upstream_untouched(rank: int, world: int) -> dict[str, Any]:
    """Upstream's stack built by upstream's strategy and by the plugin's
    upstream strategy: classes, instance attributes, and the same requests
    through both (bytes, locs, tree)."""
    from tests.helpers.sglang_0523.scenarios import _drive, _same_nodes, _setup

    _setup()
    import torch
    import torch.distributed as dist

    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    out: dict[str, Any] = {"copy_path_lines": {}}
    runs = {}
    for name, extra in (("upstream", {}), ("via_plugin", {"upstream_via_plugin": True}),
                        ("library", {"copy_path": "library"})):
        config = ShardedStackConfig(cp_size=world, device_pages=10, host_pages=24, **extra)
        with _start_up_lines() as lines:
            stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
        out["copy_path_lines"][name] = [line for line in lines if "Copy path:" in line]
        if name == "library":
            out["library_replaced"] = _replaced_on_instances(stack)
            stack.close()
            continue
        out[name] = {
            "types": {
                "controller": type(stack.controller).__name__,
                "engine": type(stack.controller.l2_transfer_engine).__name__,
                "host_pool": type(stack.kv_host).__name__,
            },
            "replaced": _replaced_on_instances(stack),
            "attributes": _attribute_names(stack),  # before the driver instruments anything
        }
        runs[name] = (stack, _drive(stack))
    (_, up), (_, via) = runs["upstream"], runs["via_plugin"]
    rows = lambda run: [(r.device_hit_tokens, r.host_hit_tokens, r.loaded_tokens, r.verified_pages,  # noqa: E731
                         r.corrupted_pages) for r in run["records"]]
    out["same_records"] = rows(up) == rows(via) and sum(r[3] for r in rows(up)) > 0
    out["same_digest"] = up["totals"].tree_digest == via["totals"].tree_digest
    out["same_nodes"] = _same_nodes(up["backed_up"], via["backed_up"]) and _same_nodes(up["restored"], via["restored"])
    out["host_bytes_equal"] = [torch.equal(a, b) for a, b in zip(up["host_after_backup"], via["host_after_backup"])]
    out["device_bytes_equal"] = all(
        torch.equal(a, b) for a, b in zip(up["device_after_restore"], via["device_after_restore"])
    )
    for stack, _ in runs.values():
        stack.close()
    return out


# ---- upstream finding 1, and the library's owner-aware host room on the same requests -----


def finding_host_eviction(rank: int, world: int, copy_path: str = "upstream") -> dict[str, Any]:
    """Upstream finding 1 (see docs/sglang-0.5.23.md): a write-through backup
    evicts host pages sized in tokens against the min-class floor, once, and
    then fails to allocate its owner-cyclic host slots although evictable host
    pages of the short class remain. Four requests, CP 2. On the library
    stack (``copy_path="library"``) the same requests back every node up."""
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from sglang_cp_hicache.testing.content import poison_device
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    a = list(range(1000, 1000 + 171))
    b = a[:67] + list(range(2000, 2000 + 316))
    c = list(range(3000, 3000 + 177))
    d = c + list(range(4000, 4000 + 149))
    stack = build_sharded_rank_stack(
        ShardedStackConfig(cp_size=world, device_pages=6, host_pages=5, copy_path=copy_path), rank,
        cp_group=dist.group.WORLD,
    )
    cache, slots = stack.cache, stack.kv_host._slots
    placement = stack.placement
    failures: list[dict[str, Any]] = []
    backup = cache._execute_kv_backup

    def host_only_pages_by_class() -> list[int]:
        counts = [0] * world
        todo = [cache.tree_core.root_node]
        while todo:
            node = todo.pop()
            todo.extend(node.children.values())
            data = node.component(ComponentType.FULL)
            if node.parent is not None and data.value is None and data.host_value is not None and data.host_lock_ref == 0:
                for owner in placement.owner_of(data.host_value[::P].to(torch.int64)).tolist():
                    counts[owner] += 1
        return counts

    backups: list[tuple[int, int]] = []  # (node id, host pages) of every backup made

    def watched_backup(node_id: Any, device_value: Any, *args: Any) -> Any:
        free_before = slots.class_free_page_counts()
        out = backup(node_id, device_value, *args)
        if out is not None:
            backups.append((int(node_id), len(out) // P))
        if out is None:
            pages = len(device_value) // P
            start = cache.tree_core.rotation_phase_of(node_id) % world
            failures.append({
                "pages": pages,
                "need_by_class": PageInterleavePoolAllocator._class_counts(start, pages, world),
                "host_free_before": free_before,
                "host_free_after": slots.class_free_page_counts(),
                "evictable_host_pages_after": host_only_pages_by_class(),
            })
        return out

    cache._execute_kv_backup = watched_backup
    engine = ShardedSimRankEngine(stack)
    records = [engine.serve(i, tokens) for i, tokens in enumerate((a, b, c, d))]
    first_failures, first_write_failures = list(failures), engine._totals.write_failures
    # Then everything off the device, poisoned, and served again: what was
    # backed up comes back from the host and is checked byte for byte.
    cache.evict(EvictParams(num_tokens=stack.allocator.size))
    poison_device(stack.kv_pool)
    records += [engine.serve(4 + i, tokens) for i, tokens in enumerate((a, b, c, d))]
    totals = engine.totals()
    room = stack.cp.host_room if copy_path == "library" else None
    out = {
        # the four requests of the finding
        "failures": first_failures, "write_failures": first_write_failures,
        # and the whole run (with the reloads)
        "write_failures_total": engine._totals.write_failures, "backups": backups,
        "host_hit_tokens": [r.host_hit_tokens for r in records],
        "loaded_tokens": [r.loaded_tokens for r in records],
        "verified_pages": sum(r.verified_pages for r in records),
        "restored_pages_verified": sum(r.restored_pages_verified for r in records),
        "corrupted_pages": sum(r.corrupted_pages for r in records),
        "digest": totals.tree_digest, "invariant_violations": totals.invariant_violations,
        "host_room": None if room is None else vars(room.counters),
    }
    stack.close()
    return out
