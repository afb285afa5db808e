"""Rank scenarios for the library's owner-aware host room on the sharded
stack (run through :func:`tests.helpers.sglang_0523.ranks.run_ranks`)."""

from __future__ import annotations

from typing import Any

P = 64


def _host_only_pages(cache: Any, placement: Any, world: int) -> tuple[list[int], int]:
    """Pages of each class held by host-only, unlocked nodes whose whole
    subtree is host-only and unlocked (what host eviction could ever free),
    and how many such nodes there are; read off the tree independently of
    the library's walk."""
    import torch
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    def clearable(node: Any) -> bool:
        data = node.component(ComponentType.FULL)
        unlocked = all(cd.lock_ref == 0 and cd.host_lock_ref == 0 for cd in node.component_data)
        return data.value is None and data.host_value is not None and unlocked and all(
            clearable(child) for child in node.children.values()
        )

    counts, nodes = [0] * world, 0
    todo = list(cache.tree_core.root_node.children.values())
    while todo:
        node = todo.pop()
        todo.extend(node.children.values())
        if clearable(node):
            nodes += 1
            for owner in placement.owner_of(node.component(ComponentType.FULL).host_value[::P].to(torch.int64)).tolist():
                counts[owner] += 1
    return counts, nodes


def _finish(out: dict[str, Any], stack: Any, engine: Any, records: list[Any]) -> dict[str, Any]:
    """``out`` with each request's hits and checks, the tree's digest and the
    engine's invariant violations added; the stack closed."""
    out["records"] = [
        {k: getattr(r, k) for k in ("device_hit_tokens", "host_hit_tokens", "loaded_tokens",
                                    "verified_pages", "restored_pages_verified", "corrupted_pages")}
        for r in records
    ]
    totals = engine.totals()
    out["digest"], out["invariant_violations"] = totals.tree_digest, totals.invariant_violations
    stack.close()
    return out


def _snapshot(stack: Any, world: int) -> dict[str, Any]:
    cache = stack.cache
    reach, nodes = _host_only_pages(cache, stack.placement, world)
    return {
        "free": stack.kv_host._slots.class_free_page_counts(), "reach": reach, "host_only_nodes": nodes,
        "host_leaves": sorted(node.id for node in cache.tree_core.evictable_host_leaves),
        "room": dict(vars(stack.cp.host_room.counters)),
    }


def unfittable_runs(rank: int, world: int) -> dict[str, Any]:
    """Runs that no host eviction can make fit: one the host-only pages
    cannot cover while the rest of the host holds copies of pages still on
    the device (``make_room`` itself), then a backup larger than the host
    (through the engine). The host room evicts nothing for either; what the
    host held comes back bit-exact afterwards; then a run that eviction can
    make fit still gets its room."""
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    import torch.distributed as dist
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.policy_0523.host_room import cyclic_class_counts
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    config = ShardedStackConfig(cp_size=world, device_pages=8, host_pages=5, copy_path="library")
    stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
    room = stack.cp.host_room
    engine = ShardedSimRankEngine(stack)
    a, b, c = (list(range(base, base + pages * P)) for base, pages in ((1000, 3), (2000, 2), (3000, 4)))
    d = list(range(4000, 4000 + (config.host_pages * world + 1) * P))  # one page more than the host
    records = [engine.serve(i, tokens) for i, tokens in enumerate((a, b))]
    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))  # a and b: host only
    records.append(engine.serve(2, c))  # c: on the device, its copy on the host
    out: dict[str, Any] = {"before": _snapshot(stack, world)}
    # The shortest run from class 0 the free and host-only pages cannot cover.
    free, reach = out["before"]["free"], out["before"]["reach"]
    pages = next(
        n for n in range(1, 2 * config.host_pages * world)
        if any(k > f + r for k, f, r in zip(cyclic_class_counts(0, n, world), free, reach))
    )
    out["unfittable_pages"] = pages
    out["unfittable_fits"] = room.make_room(0, pages)
    out["after_unfittable"] = _snapshot(stack, world)
    failures = engine._totals.write_failures
    records.append(engine.serve(3, d))  # its backup cannot fit: it fails, as upstream's would
    out["oversized_write_failures"] = engine._totals.write_failures - failures
    out["after_oversized"] = _snapshot(stack, world)
    records.append(engine.serve(4, a))  # a comes back from the host
    out["after_restore"] = _snapshot(stack, world)
    # A run that eviction can make fit: one page more than is free of class 0.
    fits_pages = next(
        n for n in range(1, 2 * config.host_pages * world)
        if cyclic_class_counts(0, n, world)[0] > out["after_restore"]["free"][0]
    )
    out["fittable_pages"] = fits_pages
    out["fittable_fits"] = room.make_room(0, fits_pages)
    out["after_fittable"] = _snapshot(stack, world)
    return _finish(out, stack, engine, records)


def _node_state(node: Any, page_owners: Any) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    host = node.component(ComponentType.FULL).host_value
    return {
        "id": node.id, "tokens": len(node.key), "first_token": int(node.key.token_ids[0]),
        "host": host.tolist(), "time": node.last_access_time,
        "owners": page_owners(host[::P].to(torch.int64)).tolist(), "base": node.rotation_base,
        "on_device": node.component(ComponentType.FULL).value is not None,
        "parent_is_root": node.parent.parent is None,
    }


def tail_eviction(rank: int, world: int, forge_hashes: bool = False) -> dict[str, Any]:
    """Two host-only leaves fill the host (``a``: 6 pages, least recently
    used; ``b``: 4 pages); a one-page request's backup is then one page of a
    class short. Only the shortest tail of ``a`` that holds a page of that
    class is evicted, its prefix stays a host node (then ``a`` again loads
    that prefix back from the host). ``forge_hashes``: ``a`` carries hash
    values that do not match its pages, so it is not split but evicted whole."""
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    import torch.distributed as dist
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    config = ShardedStackConfig(cp_size=world, device_pages=8, host_pages=5, copy_path="library")
    stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
    room, tree = stack.cp.host_room, stack.cache.tree_core
    engine = ShardedSimRankEngine(stack)
    a, b, c = (list(range(base, base + pages * P)) for base, pages in ((1000, 6), (2000, 4), (3000, 1)))
    records = [engine.serve(i, tokens) for i, tokens in enumerate((a, b))]
    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))  # a and b: host only
    leaves = {len(n.key) // P: n for n in tree.evictable_host_leaves}
    node_a, owner_of = leaves[6], stack.placement.owner_of
    if forge_hashes:
        node_a.hash_value = ["stale"] * 5  # one short of its 6 pages
    out: dict[str, Any] = {
        "before": _snapshot(stack, world), "a": _node_state(node_a, owner_of), "b": _node_state(leaves[4], owner_of),
    }
    records.append(engine.serve(2, c))  # its backup needs one host page of a class now full
    out["after"] = _snapshot(stack, world)
    out["tails_split"], out["pages_kept"] = room.tails_split, room.pages_kept
    out["host_nodes_after"] = sorted((_node_state(n, owner_of) for n in _all_nodes(tree) if n.backuped),
                                     key=lambda s: s["id"])
    records.append(engine.serve(3, a))  # a again: what stayed of it comes back from the host
    out["records"] = [
        {k: getattr(r, k) for k in ("device_hit_tokens", "host_hit_tokens", "loaded_tokens",
                                    "verified_pages", "restored_pages_verified", "corrupted_pages")}
        for r in records
    ]
    totals = engine.totals()
    out["indexer_pages_verified"] = engine.indexer_pages_verified
    out["digest"], out["invariant_violations"] = totals.tree_digest, totals.invariant_violations
    stack.close()
    return out


def _all_nodes(tree: Any) -> list[Any]:
    nodes, todo = [], list(tree.root_node.children.values())
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(node.children.values())
    return nodes


def prefix_first(rank: int, world: int, tail_rule: str) -> dict[str, Any]:
    """CP 2, the host full with three host-only leaves in LRU order: ``q`` (1
    page, class 0), ``a`` (5 pages from class 1: 1 0 1 0 1), ``b`` (4 pages
    from class 0). A run short of class 1 passes over ``q`` and takes ``a``'s
    last page; then a run short of class 0. Under ``covering`` the prefix
    kept of ``a`` goes first and gives its last page; ``q``, older, stays
    (``shortest``: in LRU order ``q`` goes; ``whole``: ``a`` went whole, so
    the second run fits without evicting). Then ``q`` and ``a`` are served
    again: what stayed of them loads back bit-exact."""
    import os

    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    import torch.distributed as dist
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    os.environ["SGLANG_CP_HICACHE_HOST_TAIL"] = tail_rule
    try:
        config = ShardedStackConfig(cp_size=world, device_pages=8, host_pages=5, copy_path="library")
        stack = build_sharded_rank_stack(config, rank, cp_group=dist.group.WORLD)
    finally:
        del os.environ["SGLANG_CP_HICACHE_HOST_TAIL"]
    room, tree, owner_of = stack.cp.host_room, stack.cache.tree_core, stack.placement.owner_of
    engine = ShardedSimRankEngine(stack)
    q, a, b = (list(range(base, base + pages * P)) for base, pages in ((1000, 1), (2000, 5), (3000, 4)))
    records = [engine.serve(i, tokens) for i, tokens in enumerate((q, a, b))]
    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))  # all three: host only
    by_first = {int(n.key.token_ids[0]): n for n in tree.evictable_host_leaves}
    out: dict[str, Any] = {
        "tail_rule": room.tail_rule, "before": _snapshot(stack, world),
        "leaves": {name: _node_state(by_first[t[0]], owner_of) for name, t in (("q", q), ("a", a), ("b", b))},
    }
    out["fits"] = [room.make_room(1, 1)]
    out["after_first"] = _snapshot(stack, world)
    out["fits"].append(room.make_room(0, 1))
    out["after_second"] = _snapshot(stack, world)
    out["tails_split"], out["pages_kept"] = room.tails_split, room.pages_kept
    out["host_nodes"] = sorted((_node_state(n, owner_of) for n in _all_nodes(tree) if n.backuped),
                               key=lambda s: s["id"])
    records += [engine.serve(3 + i, tokens) for i, tokens in enumerate((q, a))]
    return _finish(out, stack, engine, records)
