"""One rank of the 0.5.23 state machine (``test_state_machine_0523.py``):
two sharded stacks side by side in this process -- upstream's copy path and
this library's -- driven by the same calls, and checked after each.

Every call runs on every rank in the same order (a :class:`RankPool` sends
each rank the same call), on the upstream stack first, then the library's;
each ends with the scheduler's per-iteration ``check_hicache_events``. Its
answer carries, per path, what the step did and :meth:`MachineRank._check`:
the tree digest (keys, logical device locs, logical host slots, evicted /
backed up, rotation base, lock counts), leak and owner violations, nodes
whose KV or indexer bytes differ from what was written, how many host nodes
the path has freed outside an explicit host eviction (a backup making host
room, where the two paths deliberately differ), and whether the two paths'
device and host buffers are byte-identical.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

from tests.helpers.sglang_0523.scenarios import _device_buffers, _host_buffers

P = 64
PATHS = ("upstream", "library")
HOST_FILL = 0x5A  # unwritten host bytes compare equal across paths


@dataclass
class _Path:
    """One copy path's stack on this rank, and what the machine tracks of it."""

    stack: Any
    engine: Any
    locks: list[Any] = field(default_factory=list)
    host_frees_requested: int = 0  # host nodes freed by explicit host evictions


def make_rank(rank: int, world: int) -> "MachineRank":
    """The :class:`RankPool` factory (module level: the pool pickles it)."""
    import warnings

    # SGLang's import warns, per process, that quantization kernels need CUDA
    warnings.filterwarnings("ignore", message="Only CUDA")
    return MachineRank(rank, world)


class MachineRank:
    def __init__(self, rank: int, world: int) -> None:
        from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable

        ensure_sglang_importable()
        import logging

        logging.getLogger("sglang").setLevel(logging.ERROR)
        self.rank, self.world = rank, world
        self.paths: dict[str, _Path] = {}
        self.requests = 0
        self.seed = 0

    # ---- building ----------------------------------------------------------------
    def build(self, *, device_pages: int, host_pages: int, host_layout: str, num_layers: int,
              seed: int) -> dict[str, Any]:
        """Fresh stacks for both paths (the old ones closed)."""
        import torch.distributed as dist

        from sglang_cp_hicache.testing.content import poison_device
        from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
        from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

        self.close()
        self.requests, self.seed = 0, seed
        self._key_cache: dict[tuple, tuple[Any, int]] = {}
        for name in PATHS:
            config = ShardedStackConfig(
                cp_size=self.world, device_pages=device_pages, host_pages=host_pages,
                host_layout=host_layout, num_layers=num_layers, copy_path=name,
            )
            stack = build_sharded_rank_stack(config, self.rank, cp_group=dist.group.WORLD)
            for buf in _host_buffers(stack):
                buf.fill_(HOST_FILL)
            poison_device(stack.kv_pool)
            self.paths[name] = _Path(stack, ShardedSimRankEngine(stack, content_seed=seed))
        return self._check()

    def close(self) -> None:
        for path in self.paths.values():
            for lock in path.locks:
                path.engine.cache.unlock(lock)
            path.stack.close()
        self.paths = {}

    # ---- steps (the same on every rank, upstream first) ----------------------------
    def request(self, *, tokens: list[int]) -> dict[str, Any]:
        """Serve one request: match, load-back, evict, alloc, write, insert, events."""
        index, self.requests = self.requests, self.requests + 1
        records = {}
        for name, path in self.paths.items():
            r = path.engine.serve(index, tokens)
            records[name] = (r.device_hit_tokens, r.host_hit_tokens, r.loaded_tokens, r.new_tokens,
                             r.skipped, r.corrupted_pages, r.verified_pages)
        return self._check(records=records)

    def evict_device(self, *, num_tokens: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        evicted = {}
        for name, path in self.paths.items():
            evicted[name] = int(path.engine.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted)
            path.engine._check_events()
        return self._check(records=evicted)

    def evict_host(self, *, num_tokens: int) -> dict[str, Any]:
        evicted = {}
        for name, path in self.paths.items():
            before = path.engine._totals.host_evicted_nodes
            evicted[name] = int(path.engine.cache.evict_host(num_tokens))
            path.host_frees_requested += path.engine._totals.host_evicted_nodes - before
            path.engine._check_events()
        return self._check(records=evicted)

    def lock(self, *, tokens: list[int]) -> dict[str, Any]:
        """Hold a lock on the device node ``tokens`` match (as a running request does)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        matched = {}
        for name, path in self.paths.items():
            cache = path.engine.cache
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
            path.locks.append(cache.lock(match.last_device_node))
            matched[name] = int(match.device_prefix_len)
            path.engine._check_events()
        return self._check(records=matched)

    def unlock(self, *, index: int) -> dict[str, Any]:
        for path in self.paths.values():
            path.engine.cache.unlock(path.locks.pop(index))
            path.engine._check_events()
        return self._check()

    def events(self) -> dict[str, Any]:
        for path in self.paths.values():
            path.engine._check_events()
        return self._check()

    def sabotage(self, *, path: str, part: str) -> dict[str, Any]:
        """Test hook: flip one byte of ``path``'s buffers -- the first owned
        device page's KV row or indexer row, or the first host slot's KV row
        -- and check, so a test can see the machine's checks fail."""
        stack = self.paths[path].stack
        if part == "host":
            _host_buffers(stack)[0].view(-1)[0] ^= 0x01
            return self._check()
        engine = self.paths[path].engine
        for node in engine._nodes():
            value = node.component(_full()).value
            if node.evicted or value is None:
                continue
            import torch

            owned = value.to(torch.int64)[engine.placement.owned_by_this_rank(value.to(torch.int64))]
            if owned.numel():
                slot = int(engine.placement.logical_locs_to_physical(owned[:1]))
                if part == "indexer":
                    stack.kv_pool.index_k_with_scale_buffer[0][slot // P, 0] ^= 0x01
                else:
                    stack.kv_pool.kv_buffer[0].view(torch.uint8)[slot, 0, 0] ^= 0x01
                break
        return self._check()

    # ---- checks ----------------------------------------------------------------------
    def _check(self, records: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        out: dict[str, Any] = {"records": records}
        for name, path in self.paths.items():
            engine = path.engine
            violations = engine.invariant_violations()
            if path.locks:  # the machine holds these on purpose; the digest pins lock counts
                violations = [v for v in violations if not v.startswith("nodes still locked")]
            out[name] = {
                "digest": engine.tree_digest(),
                "violations": violations,
                "room_frees": engine._totals.host_evicted_nodes - path.host_frees_requested,
            }
        if not self.paths:
            return out
        up, lib = (self.paths[name].stack for name in PATHS)  # both live here: compare bytes directly
        out["same_device_bytes"] = all(map(_same, _device_buffers(up), _device_buffers(lib)))
        out["same_host_bytes"] = all(map(_same, _host_buffers(up), _host_buffers(lib)))
        out["upstream"]["bad_pages"] = self._bad_device_pages(self.paths["upstream"].engine)
        # One tree and the same device bytes give the same verdict: check the library's only when they differ.
        same = out["same_device_bytes"] and out["upstream"]["digest"] == out["library"]["digest"]
        out["library"]["bad_pages"] = (
            out["upstream"]["bad_pages"] if same else self._bad_device_pages(self.paths["library"].engine)
        )
        return out

    def _bad_device_pages(self, engine: Any) -> list[str]:
        """Every device-resident node's owned tokens against the content their
        keys give (KV rows and indexer rows, every layer), in one batch; the
        nodes whose bytes differ."""
        import torch

        from sglang_cp_hicache.testing.content import corrupted_token_mask

        placement = engine.placement
        nodes, phys, keys, owners = [], [], [], []
        todo = [(engine._root(), 0)]
        while todo:
            node, h = todo.pop()
            for child in node.children.values():
                child_keys, child_h = self._keys(child, h)
                todo.append((child, child_h))
                value = child.component(_full()).value
                if child.evicted or value is None:
                    continue
                locs = value.to(torch.int64)
                mask = placement.owned_by_this_rank(locs)
                nodes.append(child)
                phys.append(placement.logical_locs_to_physical(locs[mask]))
                keys.append(child_keys[mask])
                owners.append(torch.full((int(mask.sum()),), len(nodes) - 1, dtype=torch.int64))
        if not nodes:
            return []
        wrong = corrupted_token_mask(engine.kv_pool, torch.cat(phys), torch.cat(keys), seed=self.seed)
        bad_nodes = torch.unique(torch.cat(owners)[wrong]).tolist()
        return [f"node {nodes[i].id} ({len(nodes[i].key)} tokens from {nodes[i].key.token_ids[0]}): "
                f"{int(wrong[torch.cat(owners) == i].sum())} owned tokens differ" for i in bad_nodes]

    def _keys(self, node: Any, h: int) -> tuple[Any, int]:
        """Content keys of ``node``'s tokens after a prefix ending in key
        ``h``, cached by node id, prefix key and length (a split shortens a
        node and gives the rest to a new one)."""
        cache_key = (node.id, h, len(node.key))
        got = self._key_cache.get(cache_key)
        if got is None:
            got = self._key_cache[cache_key] = _extend_keys(h, node.key.token_ids)
        return got


def _full() -> Any:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.FULL


def _extend_keys(h: int, tokens: Any) -> tuple[Any, int]:
    """Content keys of ``tokens`` continuing a prefix whose last key is ``h``, and the last one."""
    from sglang_cp_hicache.testing.content import prefix_keys

    keys = prefix_keys(tokens, start=h)
    return keys, int(keys[-1]) if len(keys) else h


def _same(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a, b)
