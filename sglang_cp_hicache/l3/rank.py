"""One CP rank's L3, as both adapters build it.

Start-up is in two steps, so that no rank is ever left waiting for a peer:

1. :func:`open_tier` (before the CP ranks' start-up agreement) opens the
   store and the tier and never raises: an unusable store becomes this
   rank's agreement view (``unusable: ...``), so every rank sees it in the
   one all-gather and every rank stops with the L3 message at once;
2. :class:`RankL3` (after the agreement) puts the prefetch protocol and the
   writer on the tier with the release's :class:`~.prefetch.L3Port`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Counters
from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.prefetch import L3Port, L3Prefetcher
from sglang_cp_hicache.l3.workers import L3Workers
from sglang_cp_hicache.l3.writes import L3Writer
from sglang_cp_hicache.settings import L3_THREADS, read_int

__all__ = ["L3Opening", "RankL3", "open_tier"]

logger = logging.getLogger(__name__)


@dataclass
class L3Opening:
    """The L3 of one rank at start-up: ``tier`` (None: off or unusable),
    ``view`` (its start-up agreement value: ``off``, the namespaces, or the
    problem) and ``error`` (raised once the ranks agree)."""

    location: L3Location
    tier: Optional[HostL3Tier] = None
    view: str = "off"
    error: Optional[Exception] = None

    def raise_if_unusable(self) -> None:
        if self.error is not None:
            raise ValueError(str(self.error)) from self.error


def open_tier(location: L3Location, build: Callable[[], HostL3Tier]) -> L3Opening:
    """``build()`` the rank's tier when ``location`` has an L3; a failure of
    any kind becomes the opening's view and error (see the module doc)."""
    if not location.enabled:
        return L3Opening(location)
    try:
        tier = build()
    # ImportError, RuntimeError: a store client missing or refusing to start
    # (Mooncake) is this rank's view too, raised only after the agreement.
    except (ValueError, TypeError, AttributeError, KeyError, ImportError, RuntimeError, OSError) as exc:
        return L3Opening(location, None, f"unusable: {exc}", exc)
    return L3Opening(location, tier, tier.describe())


class RankL3:
    """The rank's L3 once the ranks agree: its tier, the prefetch protocol
    (reads) and the writer, each on its own bounded I/O threads."""

    def __init__(self, tier: HostL3Tier, port: L3Port, location: L3Location) -> None:
        threads = read_int(L3_THREADS)
        rank = tier.layout.cp_rank
        self.tier = tier
        self.port = port
        self.location = location
        self.read_workers = L3Workers(f"cp-hicache-l3-rank{rank}-read", threads)
        self.write_workers = L3Workers(f"cp-hicache-l3-rank{rank}-write", threads)
        self.prefetcher = L3Prefetcher(tier, port, self.read_workers, location.timeouts)
        self.writer = L3Writer(tier, self.write_workers, location.timeouts)

    @property
    def counters(self) -> L3Counters:
        return self.tier.counters

    def describe(self) -> str:
        return self.tier.describe()

    def wait_io(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's lookup I/O and writes are done; False if
        ``timeout`` ran out first."""
        return self.prefetcher.wait_io(timeout) and self.writer.wait(timeout)

    def close(self) -> None:
        """Stop the I/O threads (queued jobs are dropped; running ones finish)."""
        self.read_workers.shutdown()
        self.write_workers.shutdown()
