"""Rank scenario: the scheduler's own frees on the sharded stack with device
locs that raise on any host read (run by ``test_no_sync_requests.py``).

Requests are real ``Req`` objects with ``req_to_token`` rows, scheduled in
batches as the prefill scheduler does (match, lock, evict, load back, then
allocate every request of the batch before any finishes) and released with
upstream's ``release_kv_cache(req, cache, checkpoint=True)``, some batches
inside a free group as the scheduler's result processing opens one. That
reaches the two frees of a request's pages: the tree's duplicate frees
during the insert (a request whose prompt another request of its batch
inserted first) and ``free_kv_row`` of what the request still owns (its
unaligned tail; its whole row when the insert is declined because the
chains' rotations differ). Device eviction, write-through, host eviction and
load-back run between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

P = 64


@dataclass
class _Spec:
    tokens: list[int]
    base_of: Optional[int] = None  # a new chain takes the rotation base of this earlier request of the batch
    other_base: bool = False  # ... plus one: another rotation (its insert is declined)


def _batches() -> list[tuple[bool, list[_Spec]]]:
    """(inside a free group, requests). The second copy of x (and of y)
    duplicates the first's pages; x's third copy draws another rotation; w
    pushes x off the device, and x comes back from the host with an
    extension of its own."""
    x = list(range(1000, 1000 + 3 * P + 10))
    y = list(range(2000, 2000 + 4 * P + 7))
    z = list(range(3000, 3000 + 4 * P))
    x2 = x[: 3 * P] + list(range(5000, 5000 + 2 * P + 3))
    w = list(range(6000, 6000 + 14 * P))
    return [
        (True, [_Spec(x), _Spec(x, base_of=0), _Spec(x, base_of=0, other_base=True)]),
        (False, [_Spec(y), _Spec(y, base_of=0), _Spec(z)]),
        (True, [_Spec(x2), _Spec(y)]),
        (False, [_Spec(w)]),
        (True, [_Spec(x), _Spec(x2, base_of=0)]),
    ]


class _Scheduler:
    """One rank's prefill scheduler over a sharded stack (content fill and
    check as device work: the forward pass's job)."""

    def __init__(self, stack: Any) -> None:
        from sglang_cp_hicache.testing.requests_0523 import SchedulerRequests
        from tests.helpers.device_index import wrap
        from tests.helpers.sglang_0523.scenarios_bookkeeping import _Driver

        self.stack, self.cache, self.allocator = stack, stack.cache, stack.allocator
        self.content = _Driver(stack)  # its _content: the fill and check
        self.requests = SchedulerRequests(stack.cache, rows=4, max_tokens=16 * P)
        self.requests.pool.req_to_token = wrap(self.requests.pool.req_to_token)
        self.served = 0

    def _schedule(self, index: int, spec: _Spec, bases: list[Optional[int]]) -> tuple[Any, Optional[int]]:
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from array import array

        from sglang_cp_hicache.testing.requests_0523 import LoadBackRequest

        cache, n, tokens = self.cache, self.stack.placement.cp_size, spec.tokens
        # the scheduler matches at most len - 1 tokens: a request keeps one to compute
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[: len(tokens) - 1]))))
        admission = cache.lock(match.last_device_node)
        evict_from_tree_cache(cache, len(tokens) + P * n)
        last = match.last_device_node
        if match.host_hit_length > 0:
            request = LoadBackRequest(f"r{index}", match.last_device_node,
                                       cache.rotation_base_of(match.best_match_node))
            loaded, last = cache.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=int(match.host_hit_length), req=request,
            ))
            self.content.loaded += int(loaded)
            self.content.host_hits += int(match.host_hit_length)
            cache.ready_to_load_host_cache()
        lock = cache.lock(last)
        cache.unlock(admission)
        prefix = cache.path_device_indices(last)
        self.content._content(prefix, tokens[0], check=True)
        base = cache.rotation_base_of(last) if prefix.numel() else None
        if base is None and spec.base_of is not None:
            base = (bases[spec.base_of] + int(spec.other_base)) % n
        lens = torch.tensor([prefix.numel(), len(tokens)], dtype=torch.int64)
        drawn = [base]
        new = self.allocator.alloc_extend(
            prefix_lens=lens[:1], prefix_lens_cpu=lens[:1], seq_lens=lens[1:], seq_lens_cpu=lens[1:],
            last_loc=torch.tensor([-1]), extend_num_tokens=len(tokens) - prefix.numel(), rotation_bases=drawn,
        )
        self.content._content(new, tokens[0] + prefix.numel(), check=False)
        req = self.requests.admit(
            f"r{index}", tokens, torch.cat([prefix, new]), protected_len=prefix.numel(), rotation_base=drawn[0],
            last_node=last, lock=lock,
        )
        return req, drawn[0]

    def serve(self) -> None:
        index = 0
        for grouped, specs in _batches():
            reqs, bases = [], []
            for spec in specs:
                req, base = self._schedule(index, spec, bases)
                reqs.append(req)
                bases.append(base)
                index += 1
            if grouped:
                self.allocator.free_group_begin()
            for req in reqs:
                self.requests.release(req, checkpoint=True)
                self.served += 1
            if grouped:
                self.allocator.free_group_end()
            self.cache.check_hicache_events()


def _leaks(stack: Any, pool: Any) -> list[str]:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    todo, in_tree = [stack.cache.tree_core.root_node], 0
    while todo:
        node = todo.pop()
        todo.extend(node.children.values())
        value = node.component(ComponentType.FULL).value
        if node.parent is not None and value is not None:
            in_tree += len(value)
    in_use = int(stack.allocator.size - stack.allocator.aggregate_free_size())
    out = [] if in_use == in_tree else [f"device tokens in use {in_use} != held by tree nodes {in_tree}"]
    if len(pool.free_slots) != pool.size:
        out.append(f"req_to_token rows in use: {pool.size - len(pool.free_slots)}")
    return out


def no_sync_requests(rank: int, world: int) -> dict[str, Any]:
    """The batches on a library stack whose device locs (the allocator's and
    the req_to_token rows) raise on any host read; then on upstream's stack,
    where the first read is reported."""
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    from tests.helpers.sglang_0523.scenarios_bookkeeping import first_host_read, on_both_paths, path_report

    def run(stack: Any) -> dict[str, Any]:
        scheduler = _Scheduler(stack)
        first_read = first_host_read(scheduler.serve)
        report = path_report(stack, scheduler.served, first_read, scheduler.content)
        if stack.config.copy_path == "library":
            report.update(leaks=_leaks(stack, scheduler.requests.pool) if first_read is None else None)
        return report

    return on_both_paths(rank, world, {"device_pages": 10, "host_pages": 6}, run)
