"""What the simulator's rank engines share, whichever SGLang stack they
drive: the shape of serving one request (:meth:`RankEngineBase.serve`, whose
SGLang calls each engine supplies), CPU-time accounting, and writing /
verifying / corrupting the deterministic content of this rank's pages
(:mod:`.content`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.testing.content import corrupted_token_mask, prefix_keys, write_content
from sglang_cp_hicache.testing.l3_keys import L3KeyLog
from sglang_cp_hicache.sim.records import AckCounts, CopyWall, EngineTotals, RequestRecord

__all__ = ["NewPages", "PrefixHit", "RankEngineBase", "RequestInFlight"]

_EMPTY_PAGES = torch.empty((0,), dtype=torch.int64)


@dataclass
class RequestInFlight:
    """One request while an engine serves it."""

    record: RequestRecord
    tokens: list[int]
    keys: torch.Tensor  # content key per token (:func:`.content.prefix_keys`)
    padded_len: int  # the allocation covers the partial last page
    key_len: int  # the tree holds whole pages only


@dataclass
class PrefixHit:
    """What match + load-back left the request holding (logical locs, int64)."""

    device_locs: torch.Tensor  # matched on the device
    loaded: torch.Tensor  # just loaded back from host (empty if none or refused)
    last_node: Any  # the request's last node
    lock: Any  # what releases the request's lock (the engine's own handle)

    def locs(self) -> torch.Tensor:
        return torch.cat([self.device_locs, self.loaded])


@dataclass
class NewPages:
    """The request's newly allocated logical locs (int64) and what its insert needs."""

    locs: torch.Tensor
    pages: Optional[torch.Tensor] = None  # 0.5.18 CP: the allocator's CPU page mirror
    rotation_base: Optional[int] = None  # 0.5.23: the chain's rotation base


def _page_bytes(kv_pool: Any, page_size: int) -> int:
    """Bytes of one page in a DSA device pool: ``page_size`` KV rows and one
    indexer row (keys + scales), every layer."""
    kv_token = kv_pool.kv_buffer[0][0].numel() * kv_pool.kv_buffer[0].element_size()
    index = kv_pool.index_k_with_scale_buffer[0]
    index_page = index[0].numel() * index.element_size()
    return int(kv_pool.layer_num * (page_size * kv_token + index_page))


class RankEngineBase:
    """Subclasses call :meth:`_bind_stack` first and supply the SGLang calls
    :meth:`serve` makes: :meth:`_match_and_load`, :meth:`_alloc_rest`,
    :meth:`_insert`, :meth:`_release` and :meth:`_check_events`."""

    placement: CpPlacement
    kv_pool: Any
    page_size: int
    content_seed: int

    def _bind_stack(self, stack: Any, placement: CpPlacement, content_seed: int) -> None:
        """The stack's parts every engine uses, and zeroed accounting."""
        self.stack = stack
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.kv_pool = stack.kv_pool
        self.page_size = stack.config.page_size
        self.placement = placement
        self.content_seed = content_seed
        self.acks = AckCounts()
        self.collective_cpu_seconds = 0.0  # inside the cache's all-reduce (part of cache_cpu_seconds)
        self.collective_calls = 0
        self.cache_cpu_seconds = 0.0
        self.content_cpu_seconds = 0.0
        self.indexer_pages_verified = 0  # every page check covers its indexer row too
        # Test hook: flip one byte ("kv" row or "indexer" row) of the next
        # restored page this rank owns.
        self.corrupt_next_restore = False
        self.corrupt_part = "kv"
        # Prefix page indices the last _verify found owned, just restored and intact.
        self.restored_good_pages = _EMPTY_PAGES
        # Content keys of the last token of every page whose host copy came
        # from L3 and was not loaded to the device since (empty without L3);
        # a page's content key names its whole prefix, so it identifies the
        # page in any later request.
        self._l3_page_keys: set[int] = set()
        # Page keys of the own pages L3 stored and restored, and reads that failed (empty without L3)
        self.l3_keys = L3KeyLog()
        self.page_bytes = _page_bytes(stack.kv_pool, self.page_size)
        self.copy_wall = CopyWall()
        self._time_l2_copies(stack.cache.cache_controller.l2_transfer_engine)

    def _record_l3_keys(self, l3: Any) -> None:
        """Note the page keys of every own page a lookup restores and a write
        leaves whole in L3 (``l3``: the rank's L3)."""
        self.l3_keys.install(l3)

    def _time_l2_copies(self, engine: Any) -> None:
        """Wall time of every L2 copy submission, whatever runs it (this
        library's kernels or upstream's ops): instance attributes shadow the
        transfer engine's bound methods and change nothing else."""
        wall = self.copy_wall

        def timed(submit: Any, direction: str) -> Any:
            # adds to copy_wall's <direction>_seconds, _cpu_seconds and _calls
            def run(*args: Any, **kwargs: Any) -> Any:
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    return submit(*args, **kwargs)
                finally:
                    for field, spent in (("seconds", time.perf_counter() - start),
                                         ("cpu_seconds", time.thread_time() - cpu), ("calls", 1)):
                        name = f"{direction}_{field}"
                        setattr(wall, name, getattr(wall, name) + spent)

            return run

        engine.submit_device_to_host = timed(engine.submit_device_to_host, "d2h")
        engine.submit_host_to_device = timed(engine.submit_host_to_device, "h2d")

    # ---- one request --------------------------------------------------------
    def serve(self, index: int, tokens: Sequence[int]) -> RequestRecord:
        """Serve one request, in the same order of SGLang calls on every rank."""
        request = self._new_request(index, tokens)
        with self._cache_time():
            hit = self._match_and_load(request)
        # On CPU the load ran inside ready_to_load_host_cache (synchronous
        # streams), so the restored bytes are in place; its ack is consumed
        # with the others at the end of the request, as the scheduler does
        # once per iteration.
        prefix = hit.locs()
        self._check_prefix(request.record, prefix, hit.loaded, request.keys)
        new = self._allocate_rest(request, hit, prefix)
        with self._cache_time():
            if new is None:  # everything left is locked: identical on every rank
                request.record.skipped = True
            else:
                self._insert(request, hit, prefix, new)
            self._release(hit)
            self._check_events()
        request.record.host_slots = self.host_slots_in_use()
        return request.record

    def _new_request(self, index: int, tokens: Sequence[int]) -> RequestInFlight:
        tokens = list(tokens)
        P = self.page_size
        with self._content_time():
            keys = prefix_keys(tokens)
        return RequestInFlight(
            record=RequestRecord(index=index, tokens=len(tokens)), tokens=tokens, keys=keys,
            padded_len=-(-len(tokens) // P) * P, key_len=len(tokens) // P * P,
        )

    def _check_prefix(
        self, record: RequestRecord, prefix: torch.Tensor, loaded: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """Verify every owned page of the matched prefix (after the test
        hook's corruption of a restored page, if armed)."""
        if self.corrupt_next_restore and loaded.numel():
            self._corrupt_one_byte(loaded)
        with self._content_time():
            checked, restored, corrupted = self._verify(prefix, keys[: prefix.numel()], record.device_hit_tokens)
        record.verified_pages, record.restored_pages_verified, record.corrupted_pages = checked, restored, corrupted
        self._count_l3_pages(record, keys)

    def _count_l3_pages(self, record: RequestRecord, keys: torch.Tensor) -> None:
        """Pages just restored intact whose host copy came from L3, each
        counted at its first load."""
        if not self._l3_page_keys or self.restored_good_pages.numel() == 0:
            return
        P = self.page_size
        ends = keys[self.restored_good_pages * P + P - 1].tolist()
        from_l3 = [k for k in ends if k in self._l3_page_keys]
        self._l3_page_keys.difference_update(from_l3)
        record.l3_pages_verified = len(from_l3)

    def _allocate_rest(
        self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor
    ) -> Optional[NewPages]:
        """Allocate what the prefix does not cover and write the content of
        the new tokens this rank owns; None when it does not fit."""
        with self._cache_time():
            new = self._alloc_rest(request, hit, prefix)
        if new is None or new.locs.numel() == 0:
            return new
        start = int(prefix.numel())
        request.record.new_tokens = len(request.tokens) - start
        with self._content_time():
            self._write(new.locs[: len(request.tokens) - start], request.keys[start:])
        return new

    # ---- the SGLang calls, per release ----------------------------------------
    def _match_and_load(self, request: RequestInFlight) -> PrefixHit:
        """match_prefix, lock, evict for the request, load back a host hit."""
        raise NotImplementedError

    def _alloc_rest(self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor) -> Optional[NewPages]:
        """Evict the shortfall and allocate the rest (empty locs when nothing is left)."""
        raise NotImplementedError

    def _insert(self, request: RequestInFlight, hit: PrefixHit, prefix: torch.Tensor, new: NewPages) -> None:
        """Insert the request's whole pages; free duplicates and the unaligned tail."""
        raise NotImplementedError

    def _release(self, hit: PrefixHit) -> None:
        """Drop the request's lock."""
        raise NotImplementedError

    def _check_events(self) -> None:
        """The scheduler's per-iteration check_hicache_events."""
        raise NotImplementedError

    def host_slots_in_use(self) -> int:
        raise NotImplementedError

    # ---- accounting and content ---------------------------------------------
    @contextmanager
    def _cpu_time(self, counter: str) -> Iterator[None]:
        """Adds the block's process CPU seconds to ``self.<counter>``."""
        start = time.process_time()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.process_time() - start)

    def _cache_time(self) -> ContextManager[None]:
        return self._cpu_time("cache_cpu_seconds")

    def _content_time(self) -> ContextManager[None]:
        return self._cpu_time("content_cpu_seconds")

    def _l3_totals(self, totals: EngineTotals) -> None:
        """The L3 tier's counters into ``totals`` once its last writes have
        finished; nothing without an L3 tier."""
        if self.l3 is None:
            return
        self._wait_l3_io()
        c = self.l3.counters
        totals.l3_enabled = True
        totals.l3_written_pages = c.written_pages
        totals.l3_hit_tokens = c.restored_pages * self.page_size
        totals.l3_rejected_objects = c.rejected_pages
        totals.l3_restored_keys = list(self.l3_keys.restored_keys)
        totals.l3_stored_keys = list(self.l3_keys.stored_keys)
        totals.l3_write_failures = c.write_failures
        totals.l3_dropped_writes = c.dropped_writes
        totals.l3_read_failures = self.l3_keys.read_failures
        totals.l3_timeouts = c.timeouts

    def _wait_l3_io(self) -> None:
        raise NotImplementedError

    def _write(self, locs: torch.Tensor, keys: torch.Tensor) -> None:
        """Write the content of the tokens at ``locs`` that this rank owns."""
        mask = self.placement.owned_by_this_rank(locs)
        write_content(self.kv_pool, self.placement.logical_locs_to_physical(locs[mask]), keys[mask],
                      seed=self.content_seed)
        if self._l3_page_keys:  # recomputed: a later host copy of these pages is not L3's
            self._l3_page_keys.difference_update(keys.tolist())

    def _verify(self, locs: torch.Tensor, keys: torch.Tensor, restored_from: int) -> tuple[int, int, int]:
        """(owned pages checked, of which restored, corrupted) over ``locs``
        (page-aligned); tokens at ``>= restored_from`` were just loaded back."""
        self.restored_good_pages = _EMPTY_PAGES
        if locs.numel() == 0:
            return 0, 0, 0
        P = self.page_size
        mask = self.placement.owned_by_this_rank(locs)
        if not bool(mask.any()):
            return 0, 0, 0
        bad = corrupted_token_mask(
            self.kv_pool, self.placement.logical_locs_to_physical(locs[mask]), keys[mask], seed=self.content_seed
        )
        page_of_token = torch.arange(locs.numel(), dtype=torch.int64)[mask] // P
        pages = torch.unique(page_of_token)
        bad_pages = torch.unique(page_of_token[bad])
        restored = int((pages * P >= restored_from).sum())
        # Owned, just restored and bit-exact: what an L3 count may claim.
        good = pages[(pages * P >= restored_from) & ~torch.isin(pages, bad_pages)]
        self.restored_good_pages = good
        self.indexer_pages_verified += int(pages.numel())
        return int(pages.numel()), restored, int(bad_pages.numel())

    def _corrupt_one_byte(self, restored_locs: torch.Tensor) -> None:
        mask = self.placement.owned_by_this_rank(restored_locs)
        if not bool(mask.any()):
            return  # wait for a restore that lands on this rank
        slot = int(self.placement.logical_locs_to_physical(restored_locs[mask][:1]))
        if self.corrupt_part == "indexer":
            self.kv_pool.index_k_with_scale_buffer[0][slot // self.page_size, 0] ^= 0x01
        else:
            self.kv_pool.kv_buffer[0].view(torch.uint8)[slot, 0, 0] ^= 0x01
        self.corrupt_next_restore = False

    def _leftovers(self, locked_ids: list[int]) -> list[str]:
        """Violations of a finished run: nodes still locked (the first 8 of
        ``locked_ids``) and acks the controller never consumed."""
        out = [f"nodes still locked: {locked_ids[:8]}"] if locked_ids else []
        ctrl = self.cache.cache_controller
        if ctrl.ack_write_queue or ctrl.ack_load_queue:
            out.append(f"unconsumed acks: {len(ctrl.ack_write_queue)} write, {len(ctrl.ack_load_queue)} load")
        return out

    def _root(self) -> Any:
        return self.cache.root_node

    def _nodes(self) -> list[Any]:
        """Every node of the tree but the root."""
        out, stack = [], [self._root()]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                out.append(child)
                stack.append(child)
        return out
