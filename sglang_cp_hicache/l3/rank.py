"""One CP rank's L3, as both adapters build it.

Start-up is in two steps, so that no rank is ever left waiting for a peer:

1. :func:`open_tier` (before the CP ranks' start-up agreement) opens the
   store and the tier and never raises: an unusable store becomes this
   rank's agreement view (``unusable: ...``), so every rank sees it in the
   one all-gather and every rank stops with the L3 message at once;
2. :class:`RankL3` (after the agreement) puts the prefetch protocol and the
   writer on the tier with the release's :class:`~.prefetch.L3Port`.

A rank's L3 is observable and clearable on its own (no collective): every
fetch and store is timed (:mod:`.metrics`), :meth:`RankL3.publish_metrics`
hands the step's figures to the release's metrics each scheduler step, and
:meth:`RankL3.clear` removes its deployment's objects (:mod:`.clear`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sglang_cp_hicache.l3.clear import ClearReport, clear_namespaces
from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Counters
from sglang_cp_hicache.l3.location import L3Location
from sglang_cp_hicache.l3.metrics import L3IoMeter, L3MetricsSource, L3StepFigures, MeteredTier
from sglang_cp_hicache.l3.prefetch import L3Port, L3Prefetcher, chain_hashes
from sglang_cp_hicache.l3.workers import L3Workers
from sglang_cp_hicache.l3.writes import L3Writer
from sglang_cp_hicache.settings import L3_THREADS, read_int

__all__ = ["L3Opening", "L3MetricsSink", "RankL3", "open_tier"]

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


class L3MetricsSink:
    """Where a release exports a rank's L3 figures (the adapter's): SGLang's
    storage collector and the library's counters. Called on the scheduler
    thread, once per step."""

    def publish(self, figures: L3StepFigures, totals: dict[str, float]) -> None:
        raise NotImplementedError


class RankL3:
    """The rank's L3 once the ranks agree: its tier, the prefetch protocol
    (reads) and the writer, each on its own bounded I/O threads."""

    def __init__(self, tier: HostL3Tier, port: L3Port, location: L3Location) -> None:
        threads = read_int(L3_THREADS)
        rank = tier.placement.cp_rank
        self.tier = tier
        self.port = port
        self.location = location
        self.io = L3IoMeter()
        metered = MeteredTier(tier, self.io)  # every fetch and store timed
        self.read_workers = L3Workers(f"cp-hicache-l3-rank{rank}-read", threads)
        self.write_workers = L3Workers(f"cp-hicache-l3-rank{rank}-write", threads)
        self.prefetcher = L3Prefetcher(metered, port, self.read_workers, location.timeouts)
        self.writer = L3Writer(metered, self.write_workers, location.timeouts)
        self.metrics = L3MetricsSource(tier.counters, self.io, tier.page_size)
        self.metrics_sink: Optional[L3MetricsSink] = None  # set by attach_metrics (--enable-metrics)

    def attach_metrics(self, sink: L3MetricsSink) -> None:
        """Export this rank's figures to ``sink`` from the next step on."""
        if not isinstance(sink, L3MetricsSink):
            raise TypeError(f"sink must be an L3MetricsSink, got {type(sink).__name__}")
        self.metrics_sink = sink

    @property
    def counters(self) -> L3Counters:
        return self.tier.counters

    def publish_metrics(self) -> None:
        """Hand this step's figures to the release's metrics (a no-op
        without them). Never raises: a metrics failure is logged, the
        scheduler step goes on."""
        if self.metrics_sink is None:
            return
        try:
            self.metrics_sink.publish(self.metrics.step(), self.metrics.snapshot())
        except Exception:
            logger.exception("sglang-cp-hicache L3: publishing metrics failed on cp_rank %d", self.tier.placement.cp_rank)

    def store_chain(self, tokens: Sequence[int], num_tokens: int, owners: list[int], own_slots: list[int]) -> None:
        """Store this rank's pages of a node whose host copy is final: the
        last ``num_tokens`` (whole pages) of ``tokens``, its path from the
        root; ``owners``: each page's owner; ``own_slots``: the host slot of
        each page this rank owns, in chain order. Never raises: L3 is a
        cache, a failed write is a later miss (counted)."""
        P, rank = self.tier.page_size, self.tier.placement.cp_rank
        try:
            hashes, parent = chain_hashes(self.tier, tokens, (len(tokens) - num_tokens) // P)
        except Exception:
            logger.exception("sglang-cp-hicache L3: hashing a chain of %d tokens failed on cp_rank %d",
                             num_tokens, rank)
            self.tier.counters.add(write_failures=sum(o == rank for o in owners))
            return
        self.writer.write(hashes, owners, own_slots, parent)

    def clear(self) -> ClearReport:
        """Remove every object of this deployment's two namespaces (SGLang's
        ``clear_hicache_storage``; call it alike on every rank): this rank's
        queued writes go first (up to the longest L3 deadline), then the
        whole namespaces, whatever rank wrote them. Never raises on I/O."""
        rank = self.tier.placement.cp_rank
        if not self.writer.wait(self.location.timeouts.max_s):
            logger.warning("sglang-cp-hicache L3: writes still running on cp_rank %d at the clear; what they store "
                           "afterwards stays", rank)
        digests = [self.tier.kv_ns.digest(), self.tier.indexer_ns.digest()]
        try:
            report = clear_namespaces(self.tier.store, digests)
        except Exception as exc:  # an admin call answers, it never takes the scheduler down
            logger.exception("sglang-cp-hicache L3: clearing failed on cp_rank %d", rank)
            report = ClearReport(0, 1, f"{type(exc).__name__}: {exc}")
        self.io.record_cleared(report.removed)
        if report.ok:
            logger.info("sglang-cp-hicache L3: cleared namespaces %s on cp_rank %d (%d object(s) removed by this rank)",
                        self.describe(), rank, report.removed)
        else:
            logger.error("sglang-cp-hicache L3: clearing namespaces %s on cp_rank %d left %d object(s) or listing(s) "
                         "behind: %s", self.describe(), rank, report.errors, report.detail)
        return report

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
