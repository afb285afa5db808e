"""A CPU mirror of each running request's ``req_to_token`` row, page by page.

SGLang 0.5.18's scheduler inserts into the tree from its own
``cache_unfinished_req`` / ``cache_finished_req``: the value is a slice of
the request's device row, with no CPU page mirror. Reading it back would be
one device-to-host sync per insert (and SGLang's frees in the same calls,
one more each). The pages are all known on the CPU already, so the cache
keeps them per request:

* a row starts at the extend that first allocates for it: the matched (and
  restored) prefix is the tree path down to ``req.last_node`` (its nodes'
  ``cp_pages``), followed by the pages the allocator hands out;
* ``ReqToTokenPool.alloc(reqs)`` runs just before ``alloc_extend`` and in
  the same batch order, which ties each extend segment to its request;
* a decode page follows the request's last page: that page is the
  request's own (a page no other row holds: prefixes end where the tree
  does, and every later token is allocated for this request alone);
* a chunk checkpoint rewrites the row's tree part with the tree's pages;
  a finished request's row is dropped.

Anything the mirror cannot tie to a request (a length that does not match,
an evicted prefix node, an allocation outside these calls) drops that row:
its insert reads the device once, as before, and is counted. A row is never
guessed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

__all__ = ["ExtendSegment", "RequestRows"]


@dataclass
class ExtendSegment:
    """One request's part of an ``alloc_extend``: its row grows from
    ``prefix_len`` to ``seq_len`` tokens with ``fresh_pages`` after the
    open page."""

    prefix_len: int
    seq_len: int
    fresh_pages: list[int]


@dataclass
class _Row:
    rid: Any
    pages: list[int]  # logical page of each page slot of the row


@dataclass
class _Slots:
    """The requests of the last ``ReqToTokenPool.alloc``, in batch order."""

    reqs: list
    reused: list[bool]  # the request kept its slot (chunked prefill going on)


def _lengths_match(req: Any, seg: ExtendSegment) -> bool:
    """The segment is this request's: its prefix and fill lengths (host
    metadata of SGLang's ``Req``, no device read)."""
    prefix = getattr(req, "prefix_indices", None)
    fill = getattr(req, "fill_ids", None)
    return (prefix is None or len(prefix) == seg.prefix_len) and (fill is None or len(fill) == seg.seq_len)


class RequestRows:
    """Per-request CPU page rows (see module docstring). ``prefix_pages``
    maps a tree node to the CPU pages of the path down to it (raises
    ``ValueError`` if a node on it is not on the device)."""

    def __init__(self, page_size: int, prefix_pages: Callable[[Any], torch.Tensor]) -> None:
        self.page_size = page_size
        self._prefix_pages = prefix_pages
        self.rows: dict[int, _Row] = {}
        self.page_row: dict[int, int] = {}  # a row's own page -> its req_pool_idx
        self._slots: Optional[_Slots] = None
        self._serving: Optional[_Row] = None
        self.rows_dropped = 0  # rows the mirror could not follow (their inserts read the device)

    def reset(self) -> None:
        self.rows.clear()
        self.page_row.clear()
        self._slots = None
        self._serving = None

    # ---- what SGLang's allocation calls report ------------------------------
    def watch_slots(self, req_pool: Any) -> None:
        """Learn each extend batch's request order from ``req_pool.alloc`` (SGLang's ``ReqToTokenPool``)."""
        upstream_alloc = req_pool.alloc

        def alloc(reqs):
            reused = [r.req_pool_idx is not None for r in reqs]
            got = upstream_alloc(reqs)
            self._slots = None if got is None else _Slots(list(reqs), reused)
            return got

        req_pool.alloc = alloc

    def extended(self, segments: Sequence[ExtendSegment]) -> None:
        slots, self._slots = self._slots, None
        if (
            slots is None or len(slots.reqs) != len(segments)
            or not all(_lengths_match(req, seg) for req, seg in zip(slots.reqs, segments))
        ):
            # pages handed to requests the mirror cannot name: tie nothing
            self._drop_all()
            return
        for req, reused, seg in zip(slots.reqs, slots.reused, segments):
            self._extend_row(req, reused, seg)

    def _extend_row(self, req: Any, reused: bool, seg: ExtendSegment) -> None:
        P = self.page_size
        idx = req.req_pool_idx
        rid = getattr(req, "rid", None)
        open_slots = -(-seg.prefix_len // P)
        row = self.rows.get(idx)
        if reused and row is not None and row.rid == rid and len(row.pages) >= open_slots:
            pages = row.pages[:open_slots]
        else:
            self._drop(idx, lost=reused)  # a new request's slot: the old row is done
            pages = self._tree_prefix(req, seg.prefix_len)
        if pages is None:
            self._drop(idx)
            for page in seg.fresh_pages:
                self.page_row.pop(page, None)
            return
        pages = pages + list(seg.fresh_pages)
        if len(pages) != -(-seg.seq_len // P):
            self._drop(idx)
            return
        self.rows[idx] = _Row(rid, pages)
        for page in seg.fresh_pages:
            self.page_row[page] = idx

    def _tree_prefix(self, req: Any, prefix_len: int) -> Optional[list[int]]:
        """The matched prefix's pages: the tree path to ``req.last_node``."""
        if prefix_len % self.page_size:
            return None
        node = getattr(req, "last_node", None)
        if node is None:
            return [] if prefix_len == 0 else None
        try:
            pages = self._prefix_pages(node)
        except ValueError:  # a node on the path is not on the device (here)
            return None
        if pages.numel() * self.page_size != prefix_len:
            return None
        return pages.tolist()

    def decoded(self, steps: Sequence[tuple[int, Optional[int]]]) -> None:
        """``(last_page, new_page)`` per request of a decode allocation;
        ``new_page`` None: the token went into ``last_page``."""
        for last, new in steps:
            if new is None:
                continue
            idx = self.page_row.get(last)
            row = self.rows.get(idx) if idx is not None else None
            if row is None or not row.pages or row.pages[-1] != last:
                self.page_row.pop(new, None)
                continue
            row.pages.append(new)
            self.page_row[new] = idx

    # ---- the scheduler's cache calls ------------------------------------------
    @contextlib.contextmanager
    def serving(self, req: Any) -> Iterator[None]:
        """While SGLang's ``cache_*_req`` body runs for ``req``: its row
        answers the insert's pages and the frees of its row."""
        row = self.rows.get(getattr(req, "req_pool_idx", None))
        if row is not None and row.rid != getattr(req, "rid", None):
            row = None
        self._serving = row
        try:
            yield
        finally:
            self._serving = None

    def insert_pages(self, num_tokens: int) -> Optional[torch.Tensor]:
        """The pages of the first ``num_tokens`` of the row being served."""
        row = self._serving
        if row is None or num_tokens // self.page_size > len(row.pages):
            return None
        return torch.tensor(row.pages[: num_tokens // self.page_size], dtype=torch.int64)

    def pages_to_free(self, start_pos: int, num_tokens: int) -> Optional[torch.Tensor]:
        """The pages ``row[start_pos : start_pos + num_tokens]`` touches, of
        the row being served (None: no row, SGLang's free reads the device)."""
        row = self._serving
        if row is None or num_tokens == 0:
            return None
        P = self.page_size
        first, end = start_pos // P, -(-(start_pos + num_tokens) // P)
        if end > len(row.pages):
            return None
        return torch.tensor(row.pages[first:end], dtype=torch.int64)

    def checkpointed(self, req: Any) -> None:
        """After a chunk checkpoint: the row's tree part holds the tree's
        pages now (its own duplicates were freed)."""
        idx = req.req_pool_idx
        row = self.rows.get(idx)
        if row is None or row.rid != getattr(req, "rid", None):
            self._drop(idx)
            return
        try:
            tree = self._prefix_pages(req.last_node).tolist()
        except ValueError:
            self._drop(idx)
            return
        if len(tree) > len(row.pages):
            self._drop(idx)
            return
        for page in row.pages[: len(tree)]:
            if self.page_row.get(page) == idx:
                del self.page_row[page]
        row.pages[: len(tree)] = tree

    def finished(self, req: Any) -> None:
        self._drop(getattr(req, "req_pool_idx", None), lost=False)

    def _drop(self, idx: Optional[int], *, lost: bool = True) -> None:
        row = self.rows.pop(idx, None) if idx is not None else None
        if row is None:
            return
        self.rows_dropped += int(lost)
        for page in row.pages:
            if self.page_row.get(page) == idx:
                del self.page_row[page]

    def _drop_all(self) -> None:
        self.rows_dropped += len(self.rows)
        self.rows.clear()
        self.page_row.clear()
