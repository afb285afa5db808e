"""N CP ranks of real SGLang 0.5.18 CpHiRadixCache stacks in one process.

Every rank replays the same operations (the SGLang contract: identical
scheduler decisions on every rank). With ``threaded=True`` each rank runs in
its own thread with its own gloo process group (shared in-memory store), so
the caches' consensus all-reduces are real collectives across ranks. A rank
whose stack construction fails makes its peers stop waiting at once, and the
cluster raises that rank's error (not a peer's time-out).

Content of a token is a function of its whole prefix (a rolling hash of the
token ids), written only by the rank that owns its page; restored bytes are
checked against what they must be.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.sglang_0518.hiradix import CpInsertParams
from sglang_cp_hicache.testing.content import content_mismatches, prefix_keys, write_content
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack
from tests.helpers.rank_failure import FailFastGroup, PeerRankFailed, RankFailure, release_groups

SEED = 11
#: tokens per page of the stacks these tests build (DSATokenToKVPool needs 64 outside ROCm)
P = 64


def seq(first: int, pages: int) -> list[int]:
    """``pages`` whole pages of token ids counting up from ``first``."""
    return list(range(first, first + pages * P))

_building = threading.local()


@contextmanager
def runtime_context_per_thread() -> Iterator[None]:
    """SGLang's runtime context is process-global and last-publish-wins (one
    server per process); ranks built at once in threads would each read the
    last rank's settings (a rank's host pool sized from another rank's
    ``hicache_ratio``). Inside this block each thread publishes into, and
    reads from, its own context."""
    from sglang.srt import runtime_context

    local = threading.local()

    def own() -> Any:
        if not hasattr(local, "context"):
            local.context = runtime_context.RuntimeContext(parallel=runtime_context.get_parallel())
        return local.context

    class _ThreadsOwnContext:
        def __getattr__(self, name: str) -> Any:
            return getattr(own(), name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(own(), name, value)

    shared = runtime_context._CONTEXT
    runtime_context._CONTEXT = _ThreadsOwnContext()
    try:
        yield
    finally:
        runtime_context._CONTEXT = shared


def building_rank() -> Optional[int]:
    """The group rank whose stack the current thread is building (None
    outside :func:`build_each_rank` and the threaded :class:`CpCluster`)."""
    return getattr(_building, "rank", None)


@dataclass(frozen=True)
class RankSetup:
    """How one group rank is started: the cp_rank it claims and the config
    fields it overrides (a misconfigured rank, for start-up checks)."""

    cp_rank: int
    overrides: dict = field(default_factory=dict)


def build_each_rank(
    config: CpStackConfig, per_rank: Callable[[int], RankSetup], *, timeout_s: float = 30.0
) -> list:
    """Build ``config.cp_size`` rank stacks at once, one thread each on gloo
    groups that never give up early (every rank runs its collectives to the
    end, so each rank's own outcome is seen), and return each rank's stack or exception; built
    stacks are closed. For start-up checks that must refuse on every rank."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=timeout_s)
    n = config.cp_size
    never = RankFailure()  # nothing records into it: no rank stops waiting early
    with runtime_context_per_thread(), ThreadPoolExecutor(n) as pool:
        groups = list(pool.map(
            lambda r: FailFastGroup(dist.ProcessGroupGloo(store, r, n, timeout), never), range(n)
        ))

        def build(r: int):
            _building.rank = r
            setup = per_rank(r)
            try:
                return build_cp_rank_stack(config, setup.cp_rank, cp_group=groups[r], **setup.overrides)
            finally:
                _building.rank = None

        futures = [pool.submit(build, r) for r in range(n)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result())
            except Exception as exc:  # noqa: BLE001 - each rank's own outcome
                outcomes.append(exc)
    for o in outcomes:
        if not isinstance(o, BaseException):
            o.close()
    return outcomes


@dataclass
class LoadBackReport:
    tokens: list
    loaded_per_rank: list = field(default_factory=list)


class CpCluster:
    def __init__(self, config: CpStackConfig, *, threaded: bool = False, timeout_s: float = 60.0) -> None:
        self.config = config
        self.threaded = threaded and config.cp_size > 1
        self._pool = ThreadPoolExecutor(config.cp_size) if self.threaded else None
        if self.threaded:
            self.stacks = self._build_threaded(timeout_s)
        else:
            self.stacks = [build_cp_rank_stack(config, r) for r in range(config.cp_size)]

    def _build_threaded(self, timeout_s: float) -> list:
        config = self.config
        store = dist.HashStore()
        timeout = datetime.timedelta(seconds=timeout_s)
        failure = RankFailure()
        self.groups = list(self._pool.map(
            lambda r: FailFastGroup(dist.ProcessGroupGloo(store, r, config.cp_size, timeout), failure),
            range(config.cp_size),
        ))

        def build(r: int):
            try:
                return build_cp_rank_stack(config, r, cp_group=self.groups[r])
            except PeerRankFailed:
                raise
            except BaseException as exc:
                failure.record(r, exc)
                raise

        futures = [self._pool.submit(build, r) for r in range(config.cp_size)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcomes.append(exc)
        if failure.error is None:
            return outcomes
        self._abandon([o for o in outcomes if not isinstance(o, BaseException)])
        summary = ", ".join(
            f"cp_rank {r}: {'built' if not isinstance(o, BaseException) else type(o).__name__}"
            for r, o in enumerate(outcomes)
        )
        failure.error.add_note(
            f"CpCluster: cp_rank {failure.cp_rank} of {config.cp_size} failed to build its stack "
            f"first; the other ranks stopped ({summary})"
        )
        raise failure.error

    def _abandon(self, built: list) -> None:
        """After a failed start: close the stacks that were built, release
        every gloo group without waiting for time-outs, stop the threads."""
        for stack in built:
            stack.close()
        release_groups(self.groups)
        self._pool.shutdown()

    def close(self) -> None:
        for s in self.stacks:
            s.close()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> "CpCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def caches(self):
        return [s.cache for s in self.stacks]

    def each(self, fn: Callable[[Any], Any], *, return_exceptions: bool = False) -> list:
        """``fn(stack)`` on every rank: concurrently when threaded. After all
        ranks finished, raises the first rank's exception, or returns the
        exceptions in place of results."""
        if self.threaded:
            futures = [self._pool.submit(fn, s) for s in self.stacks]
            outcomes = []
            for f in futures:
                try:
                    outcomes.append(f.result())
                except Exception as exc:  # noqa: BLE001 - collected, handled below
                    outcomes.append(exc)
        else:
            outcomes = []
            for s in self.stacks:
                try:
                    outcomes.append(fn(s))
                except Exception as exc:  # noqa: BLE001
                    outcomes.append(exc)
        if not return_exceptions:
            for o in outcomes:
                if isinstance(o, Exception):
                    raise o
        return outcomes

    # ---- content ----------------------------------------------------------
    def _fill(self, stack, locs: torch.Tensor, keys: torch.Tensor) -> None:
        placement = stack.allocator.placement
        mask = placement.owned_by_this_rank(locs)
        if bool(mask.any()):
            write_content(stack.kv_pool, placement.logical_locs_to_physical(locs[mask]), keys[mask], seed=SEED)

    def mismatches(self, stack, locs: torch.Tensor, keys: torch.Tensor) -> list[str]:
        placement = stack.allocator.placement
        mask = placement.owned_by_this_rank(locs)
        if not bool(mask.any()):
            return []
        return content_mismatches(stack.kv_pool, placement.logical_locs_to_physical(locs[mask]), keys[mask], seed=SEED)

    # ---- operations (every rank, same order) --------------------------------
    def insert(self, tokens: list[int], seed: int = 0) -> list[torch.Tensor]:
        """Prefill a whole sequence: new pages for the part not on device."""
        return self.each(self._insert_fn(tokens))

    def insert_outcomes(self, tokens: list[int]) -> list:
        return self.each(self._insert_fn(tokens), return_exceptions=True)

    def _insert_fn(self, tokens: list[int], *, check: bool = True):
        """One rank's prefill + insert; ``check=False`` leaves the step's
        all-reduce (writing_check / loading_check) to the caller."""
        keys = prefix_keys(tokens)

        def run(s):
            c = s.cache
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            hit = len(m.device_indices)
            need = len(tokens) - hit
            c.inc_lock_ref(m.last_device_node)  # the request holds its prefix (as the scheduler does)
            if s.allocator.available_size() < need:
                c.evict(EvictParams(num_tokens=need - s.allocator.available_size()))
            got = s.allocator.alloc_mirrored(need)
            if got is None:
                c.dec_lock_ref(m.last_device_node)
                return None
            new = got.locs
            locs = torch.cat([m.device_indices, new])
            self._fill(s, new, keys[hit:])
            # The CPU page mirror rides along: the cache never reads locs back.
            pages = torch.cat([c.cp_prefix_pages(m.last_device_node), got.pages])
            res = c.insert(CpInsertParams(key=RadixKey(tokens), value=locs, value_pages=pages))
            c.dec_lock_ref(m.last_device_node)
            if res.prefix_len > hit:  # tree already had part of the new pages
                s.allocator.free_mirrored(got.pages[: (res.prefix_len - hit) // s.allocator.page_size])
            if check:
                c.writing_check()
                c.loading_check()
            return locs

        return run

    def inserts_in_one_step(self, *token_lists: list[int]) -> list:
        """Every rank inserts each of ``token_lists``, then runs the step's
        all-reduce once (``writing_check``); each rank's outcome, an
        exception included."""
        runs = [self._insert_fn(tokens, check=False) for tokens in token_lists]

        def step(s):
            for run in runs:
                run(s)
            s.cache.writing_check()

        return self.each(step, return_exceptions=True)

    def insert_resident(self, tokens: list[int]) -> None:
        """Insert ``tokens`` on every rank without backing them up (yet): a
        later hit backs them up."""
        for c in self.caches:
            c.write_through_threshold = 10**9
        try:
            self.insert(tokens)
        finally:
            for c in self.caches:
                c.write_through_threshold = 1

    def step(self) -> None:
        self.each(lambda s: (s.cache.writing_check(), s.cache.loading_check()))

    def evict_device(self, num_tokens: int) -> list:
        return self.each(lambda s: s.cache.evict(EvictParams(num_tokens=num_tokens)))

    def evict_host(self, num_slots: int) -> list:
        return self.each(lambda s: s.cache.evict_host(num_slots))

    def load_back(self, tokens: list[int]) -> LoadBackReport:
        report = LoadBackReport(tokens)
        report.loaded_per_rank = self.each(self._load_back_fn(tokens))
        return report

    def load_back_outcomes(self, tokens: list[int]) -> list:
        return self.each(self._load_back_fn(tokens), return_exceptions=True)

    def _load_back_fn(self, tokens: list[int]):
        def run(s):
            c = s.cache
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            vals, last = c.init_load_back(
                InitLoadBackParams(best_match_node=m.last_host_node, host_hit_length=m.host_hit_length)
            )
            c.ready_to_load_host_cache()
            c.writing_check()
            c.loading_check()
            return (m.device_indices, vals, m.host_hit_length)

        return run

    @staticmethod
    def start_load_back(stack, tokens: list[int], *, start: bool = True, mem_quota: Optional[int] = None) -> int:
        """What a scheduler does on one rank for a request whose prefix is on
        host: the load-back, then (unless its batch is dropped) starting the
        copies; no all-reduce. Returns the tokens it restored."""
        c = stack.cache
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        locs, _ = c.init_load_back(InitLoadBackParams(
            best_match_node=m.last_host_node, host_hit_length=m.host_hit_length, mem_quota=mem_quota,
        ))
        if start:
            c.ready_to_load_host_cache()
        return int(locs.numel())

    def device_locs(self, tokens: list[int]) -> list[torch.Tensor]:
        return [c.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices for c in self.caches]

    def check(self, tokens: list[int], seed: int = 0) -> dict:
        """Bytes of every on-device token of ``tokens``, on the rank owning it."""
        keys = prefix_keys(tokens)
        bad = {}
        for s, locs in zip(self.stacks, self.device_locs(tokens)):
            errs = self.mismatches(s, locs, keys[: len(locs)])
            if errs:
                bad[s.cp_rank] = errs
        return bad

    def ack_counts(self) -> list[tuple[int, int]]:
        return [(c.cp_transfer.stats.writes, c.cp_transfer.stats.loads) for c in self.caches]

    @staticmethod
    def tree_shape(cache) -> list:
        out = []
        stack = [(cache.root_node, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                p = path + ((tuple(child.key.token_ids[:1]), len(child.key)),)
                out.append((p, child.evicted, child.backuped, child.host_len, child.lock_ref))
                stack.append((child, p))
        return sorted(out)

