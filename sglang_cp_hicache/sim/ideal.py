"""What an infinite prefix cache would hit on a request stream: the ceiling
every simulated run is read against.

The same requests in the same order, matched as SGLang matches: whole pages
from the start of the request, up to the first page whose prefix (the page
and every page before it) no earlier request held. Every whole page of
every request is kept forever. A partial last page is never matched nor
kept (SGLang caches whole pages only).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["IdealCache", "ideal_cache", "ideal_hit_tokens"]


@dataclass
class IdealCache:
    """The infinite cache after the replay."""

    hit_tokens: list[int]  # per request
    #: Whole pages it holds at the end: the distinct (page, whole prefix)
    #: pairs of the requests, i.e. the trace's working set in pages.
    distinct_pages: int


def ideal_hit_tokens(requests: Iterable[Sequence[int] | array], page_size: int) -> list[int]:
    """Per request, the tokens an infinite cache would hit (page-aligned)."""
    return ideal_cache(requests, page_size).hit_tokens


def ideal_cache(requests: Iterable[Sequence[int] | array], page_size: int) -> IdealCache:
    """The infinite cache's hits per request and the pages it ends up holding."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seen: set[bytes] = set()  # one digest per cached page: of the page's whole prefix
    out = []
    for tokens in requests:
        ids = array("q", tokens)  # one byte form whatever the source
        prefix = hashlib.blake2b(digest_size=16)
        hit_pages, missed = 0, False
        for page in range(len(ids) // page_size):
            prefix.update(ids[page * page_size : (page + 1) * page_size].tobytes())
            key = prefix.copy().digest()
            if key in seen:
                hit_pages += not missed
            else:
                missed = True
                seen.add(key)
        out.append(hit_pages * page_size)
    return IdealCache(hit_tokens=out, distinct_pages=len(seen))
