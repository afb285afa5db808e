"""Which deployment serves each request.

* ``round-robin``: deployments in turn (dead ones skipped).
* ``least-loaded``: the fewest requests outstanding (released and not yet
  finished), ties to the one given the fewest prompt tokens so far, then the
  first.
* ``prefix-affinity``: SGLang's router's ``cache_aware`` policy, on token
  pages instead of characters. Kept: one approximate prefix tree per
  deployment holding what the router sent there (not what the deployment
  still caches); the imbalance test first (``max - min`` outstanding above
  an absolute threshold *and* ``max`` above a relative threshold times
  ``min``: then the least loaded); else the deployment whose tree matches
  the longest prefix when the match rate (matched / request tokens) is
  above the cache threshold; else the deployment with the smallest tree;
  the chosen tree then takes the whole request. Defaults are the router's:
  cache threshold 0.5, absolute 32, relative 1.0001. Left out: the
  router's time-driven LRU eviction of its trees (the trees here only
  grow) and its character-level splitting (whole pages only).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["ROUTES", "AffinityParams", "Router", "make_router"]

ROUTES = ("round-robin", "prefix-affinity", "least-loaded")


@dataclass(frozen=True)
class AffinityParams:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")


@dataclass
class Router:
    """Routing state over ``count`` deployments; :meth:`pick` never returns a dead one."""

    route: str
    count: int
    page_size: int
    params: AffinityParams = field(default_factory=AffinityParams)
    outstanding: list[int] = field(init=False)
    tokens_sent: list[int] = field(init=False)
    _next: int = field(init=False, default=0)
    # page digest (of the page and its whole prefix) -> deployments whose tree holds it
    _tree: dict[bytes, set[int]] = field(init=False, default_factory=dict)
    _tree_pages: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"--route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if self.count < 1:
            raise ValueError(f"a fleet needs at least one deployment, got {self.count}")
        self.outstanding = [0] * self.count
        self.tokens_sent = [0] * self.count
        self._tree_pages = [0] * self.count

    def pick(self, tokens: Sequence[int], alive: Sequence[int]) -> int:
        """The deployment for a request of ``tokens`` among ``alive`` (not empty)."""
        if not alive:
            raise ValueError("no deployment is alive to route to")
        if self.route == "round-robin":
            choice = min(alive, key=lambda d: (d - self._next) % self.count)
            self._next = (choice + 1) % self.count
        elif self.route == "least-loaded":
            choice = self._least_loaded(alive)
        else:
            choice = self._affinity(tokens, alive)
        return choice

    def sent(self, deployment: int, tokens: Sequence[int]) -> None:
        self.outstanding[deployment] += 1
        self.tokens_sent[deployment] += len(tokens)

    def finished(self, deployment: int) -> None:
        self.outstanding[deployment] -= 1

    def _least_loaded(self, alive: Sequence[int]) -> int:
        return min(alive, key=lambda d: (self.outstanding[d], self.tokens_sent[d], d))

    def _affinity(self, tokens: Sequence[int], alive: Sequence[int]) -> int:
        digests = self._page_digests(tokens)
        loads = [self.outstanding[d] for d in alive]
        hi, lo = max(loads), min(loads)
        p = self.params
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            choice = self._least_loaded(alive)
        else:
            matched = self._matched_pages(digests, alive)
            best = max(alive, key=lambda d: (matched[d], -d))
            rate = matched[best] * self.page_size / len(tokens) if tokens else 0.0
            if matched[best] and rate > p.cache_threshold:
                choice = best
            else:
                choice = min(alive, key=lambda d: (self._tree_pages[d], d))
        self._insert(choice, digests)
        return choice

    def _page_digests(self, tokens: Sequence[int]) -> list[bytes]:
        ids = array("q", tokens)
        prefix = hashlib.blake2b(digest_size=16)
        out = []
        P = self.page_size
        for page in range(len(ids) // P):
            prefix.update(ids[page * P : (page + 1) * P].tobytes())
            out.append(prefix.copy().digest())
        return out

    def _matched_pages(self, digests: list[bytes], alive: Sequence[int]) -> dict[int, int]:
        """Per deployment, the pages of the longest prefix its tree holds (a
        page's digest names its whole prefix, so holding page k means holding
        every page before it)."""
        matched = {d: 0 for d in alive}
        for depth, digest in enumerate(digests, start=1):
            holders = self._tree.get(digest)
            if not holders:
                break
            for d in holders:
                if d in matched:
                    matched[d] = depth
        return matched

    def _insert(self, deployment: int, digests: list[bytes]) -> None:
        for digest in digests:
            holders = self._tree.setdefault(digest, set())
            if deployment not in holders:
                holders.add(deployment)
                self._tree_pages[deployment] += 1


def make_router(route: str, count: int, page_size: int, params: AffinityParams | None = None) -> Router:
    return Router(route, count, page_size, params or AffinityParams())
