"""The forward stand-in of the real-scheduler harness (both releases).

Before every forward it checks every prefix row attention would read, on the
rank that owns its page, against the row's content key (a rolling hash of
the token ids up to it, so the key is both position and prefix); then it
writes every new token's KV and indexer rows from its key. Rows are
poisoned when the allocator hands them out, so a load-back that never
happened (or landed elsewhere) cannot pass on stale bytes of an earlier
tenant. Any mismatch raises :class:`ForwardMismatch` naming request,
position and rank. Sampled tokens are a pure function of the key: every rank
samples the same, as a real model's TP ranks do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.testing.content import POISON_BYTE, expected_rows, prefix_keys, read_rows, rows_differ, write_rows

__all__ = ["BatchEntry", "BatchReport", "ForwardMismatch", "ForwardStandIn", "ForwardStats", "poison_rows"]

SEED = 7
_ALLOC_METHODS = ("alloc", "alloc_extend", "alloc_decode")


class ForwardMismatch(AssertionError):
    """A prefix row attention would read does not hold its content."""


@dataclass(frozen=True)
class BatchEntry:
    rid: str
    prefix_len: int
    extend_len: int
    # On the request's first forward: the tail of its prefix restored from L3 for it (SGLang's storage hit on
    # the request, at most what was loaded back for it and the prefix); 0 on later forwards
    l3_tokens: int = 0
    # On the request's first forward: the tokens of its prefix loaded back from host for it (L3's included,
    # at most the prefix; the rest of the prefix was a device hit); 0 on later forwards
    host_tokens: int = 0


@dataclass(frozen=True)
class BatchReport:
    """What one rank is about to forward (every rank must report the same)."""

    rank: int
    step: int
    mode: str
    entries: tuple[BatchEntry, ...]
    chunked_rid: Optional[str]
    # PD prefill: requests forwarded while their sender still bootstraps (optimistic prefill)
    bootstrapping: tuple[str, ...] = ()
    # requests of earlier batches SGLang has finished since the previous report (each named once): what
    # the parent knows for certain at this gate, whenever their outputs reach it
    finished: tuple[str, ...] = ()

    def same_batch(self, other: "BatchReport") -> bool:
        return (self.step, self.mode, self.entries, self.chunked_rid, self.bootstrapping) == (
            other.step, other.mode, other.entries, other.chunked_rid, other.bootstrapping)


@dataclass
class ForwardStats:
    written: int = 0  # owned token rows written on this rank
    verified: int = 0  # owned prefix rows checked on this rank
    l3_verified: int = 0  # of those, rows of a first forward's L3-restored prefix tail
    poisoned: int = 0  # owned rows poisoned at allocation
    batches: int = 0
    extend_batches: int = 0
    decode_batches: int = 0
    max_batch_reqs: int = 0


def poison_rows(kv_pool: Any, physical_locs: torch.Tensor, byte: int = POISON_BYTE) -> None:
    """Overwrite the KV rows and indexer key/scale cells of ``physical_locs``, every layer."""
    if physical_locs.numel():
        write_rows(kv_pool, physical_locs, byte)


@dataclass
class _Seen:
    """What the forward already derived for one request: the content keys of
    its token sequence so far, and the bytes its owned rows must hold (keys
    and rows in position order). Both are pure functions of the tokens, so a
    later chunk or decode step reuses them after an exact comparison of the
    tokens / keys, and only reads the pool afresh."""

    tokens: list[int]
    keys: torch.Tensor
    owned_keys: torch.Tensor
    owned_rows: torch.Tensor


@dataclass
class ForwardStandIn:
    """One rank's forward. ``placement`` None: every location is this rank's
    own physical slot (CP 1). ``gate`` is called with each batch's report
    before the batch runs (the parent may act, then lets it go)."""

    rank: int
    kv_pool: Any
    req_to_token: torch.Tensor
    placement: Optional[CpPlacement]
    gate: Callable[[BatchReport], None]
    scheduler: Any = None  # set once the scheduler is built (chunked request in reports)
    stats: ForwardStats = field(default_factory=ForwardStats)
    _seen: dict[str, _Seen] = field(default_factory=dict)
    _unfinished: dict[str, Any] = field(default_factory=dict)  # requests forwarded, not finished at the last gate
    # host tokens loaded back per request so far (the rank's load-back observer adds to it)
    host_loaded: dict[str, int] = field(default_factory=dict)
    _forwarded: set[str] = field(default_factory=set)  # requests forwarded at least once on this rank

    def _owned(self, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical slots of the locations this rank owns, the ownership mask)."""
        locs = locs.to(torch.int64).cpu()
        if self.placement is None:
            return locs, torch.ones(locs.numel(), dtype=torch.bool)
        mask = self.placement.owned_by_this_rank(locs)
        return self.placement.logical_locs_to_physical(locs[mask]), mask

    def poison_allocations_of(self, allocator: Any) -> None:
        """Poison this rank's rows of every location the allocator hands out."""
        for name in _ALLOC_METHODS:
            original = getattr(allocator, name, None)
            if original is not None:
                setattr(allocator, name, self._poisoning(original))

    def _poisoning(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def alloc(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.numel():
                phys, _ = self._owned(out)
                poison_rows(self.kv_pool, phys)
                self.stats.poisoned += int(phys.numel())
            return out

        return alloc

    def _l3_tail(self, req: Any, prefix_len: int) -> int:
        """Tokens at the end of a first forward's prefix that were restored from L3 for ``req``.

        SGLang sets ``storage_hit_length`` from the cache's report of the tokens its L3 lookup for this
        request inserted into the host tree; they extend the request's host match, so its load-back
        brings them to the device as the tail of its prefix. What was not loaded back (declined, or
        evicted after the request was turned away) was computed, not restored: hence the minimum."""
        rid = str(req.rid)
        if rid in self._forwarded:
            return 0
        storage = int(getattr(req, "storage_hit_length", 0) or 0)
        return max(0, min(storage, self.host_loaded.get(rid, 0), prefix_len))

    def _host_part(self, req: Any, prefix_len: int) -> int:
        """Tokens of a first forward's prefix that its load-backs brought from host (0 on a later forward)."""
        rid = str(req.rid)
        return 0 if rid in self._forwarded else min(self.host_loaded.get(rid, 0), prefix_len)

    def _report(self, batch: Any, prefix_lens: list[int], extend_lens: list[int], l3: list[int]) -> BatchReport:
        chunked = getattr(self.scheduler, "chunked_req", None)
        entries = tuple(BatchEntry(str(r.rid), int(p), int(e), t, self._host_part(r, int(p)))
                        for r, p, e, t in zip(batch.reqs, prefix_lens, extend_lens, l3))
        bootstrapping = tuple(str(r.rid) for r in batch.reqs
                              if getattr(getattr(r, "disagg_kv_sender", None), "bootstrap_polls_left", 0) > 0)
        finished = tuple(rid for rid, r in self._unfinished.items() if r.finished())
        for rid in finished:
            del self._unfinished[rid]
        self._unfinished.update((str(r.rid), r) for r in batch.reqs)
        return BatchReport(self.rank, self.stats.batches, batch.forward_mode.name, entries,
                           None if chunked is None else str(chunked.rid), bootstrapping, finished)

    def next_tokens(self, batch: Any) -> torch.Tensor:
        """Check prefixes, write new rows; the batch's sampled token ids."""
        mode = batch.forward_mode
        seq_lens = [int(x) for x in batch.seq_lens_cpu.tolist()]
        if mode.is_extend():
            prefix_lens, extend_lens = [int(x) for x in batch.prefix_lens], [int(x) for x in batch.extend_lens]
        else:  # decode: one new token per request
            prefix_lens, extend_lens = [n - 1 for n in seq_lens], [1] * len(seq_lens)
        l3 = [self._l3_tail(r, p) for r, p in zip(batch.reqs, prefix_lens)]
        self.gate(self._report(batch, prefix_lens, extend_lens, l3))
        # the tokens the forward really gets (future-map resolved under the overlap loop)
        ids = batch.input_ids.to(torch.int64).cpu().tolist()
        out = batch.out_cache_loc.to(torch.int64).cpu()
        off, nexts, seen = 0, [], {}
        for i, req in enumerate(batch.reqs):
            p, e = prefix_lens[i], extend_lens[i]
            known = list(req.origin_input_ids) + list(req.output_ids)
            if len(known) < p:
                raise ForwardMismatch(f"rank {self.rank}: request {req.rid} has {len(known)} known tokens, prefix {p}")
            before = self._seen.get(str(req.rid))
            tokens = known[:p] + ids[off: off + e]
            keys = self._keys(before, tokens)
            owned_keys, owned_rows = keys[:0], None
            if p:
                owned_keys, owned_rows = self._check_prefix(req, int(batch.req_pool_indices[i]), keys[:p], before,
                                                             l3[i])
            phys, mask = self._owned(out[off: off + e])
            new_keys = keys[p: p + e][mask]
            new_rows = expected_rows(self.kv_pool, new_keys, seed=SEED)
            if new_keys.numel():
                write_rows(self.kv_pool, phys, new_rows)
            self.stats.written += int(mask.sum())
            seen[str(req.rid)] = _Seen(tokens, keys, torch.cat([owned_keys, new_keys]),
                                       new_rows if owned_rows is None else torch.cat([owned_rows, new_rows]))
            off += e
            nexts.append(2 + int(keys[-1]) % 997)
        if off != out.numel():
            raise ForwardMismatch(f"rank {self.rank}: batch extends {off} tokens but has {out.numel()} locations")
        self._seen = seen  # only this batch's requests can be in the next one's prefix work again
        self._forwarded.update(seen)
        self._count(mode, len(batch.reqs))
        return torch.tensor(nexts, dtype=torch.int64)

    @staticmethod
    def _keys(before: Optional[_Seen], tokens: list[int]) -> torch.Tensor:
        """:func:`prefix_keys` of ``tokens``, extending the keys of a sequence
        seen before when it is a prefix of this one."""
        m = 0 if before is None else len(before.tokens)
        if before is None or m == 0 or m > len(tokens) or tokens[:m] != before.tokens:
            return prefix_keys(tokens)
        return torch.cat([before.keys, prefix_keys(tokens[m:], start=int(before.keys[-1]))])

    def _expected(self, owned_keys: torch.Tensor, before: Optional[_Seen]) -> torch.Tensor:
        """The bytes the rows of ``owned_keys`` must hold, reusing those derived
        before for an identical leading run of keys."""
        m = 0 if before is None else before.owned_keys.numel()
        if m == 0 or m > owned_keys.numel() or not torch.equal(before.owned_keys, owned_keys[:m]):
            return expected_rows(self.kv_pool, owned_keys, seed=SEED)
        return torch.cat([before.owned_rows, expected_rows(self.kv_pool, owned_keys[m:], seed=SEED)])

    def _check_prefix(self, req: Any, pool_index: int, keys: torch.Tensor, before: Optional[_Seen],
                      l3_tail: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Every owned prefix row against its key's bytes; (owned keys, their bytes).
        ``l3_tail``: the prefix's last tokens restored from L3 (their owned rows counted apart)."""
        locs = self.req_to_token[pool_index, : keys.numel()].to(torch.int64).cpu()
        phys, mask = self._owned(locs)
        owned_keys = keys[mask]
        want = self._expected(owned_keys, before)
        bad = rows_differ(read_rows(self.kv_pool, phys), want)
        self.stats.verified += int(mask.sum())
        if l3_tail:
            self.stats.l3_verified += int(mask[keys.numel() - l3_tail:].sum())
        if bool(bad.any()):
            positions = torch.nonzero(mask).flatten()[bad]
            first = int(positions[0])
            raise ForwardMismatch(
                f"rank {self.rank}: request {req.rid}: {int(bad.sum())} prefix rows attention would read do not hold "
                f"their content, first at position {first} (location {int(locs[first])}); positions "
                f"{positions[:8].tolist()}"
            )
        return owned_keys, want

    def _count(self, mode: Any, n: int) -> None:
        self.stats.batches += 1
        self.stats.max_batch_reqs = max(self.stats.max_batch_reqs, n)
        if mode.is_extend():
            self.stats.extend_batches += 1
        else:
            self.stats.decode_batches += 1
