"""One rank's L3 figures for an operator: what SGLang's own storage metrics
need each step, and the library's counters as Prometheus metrics.

Everything here is per rank and collective-free, as SGLang's storage
metrics are (each scheduler process exports its own series, labelled with
its ranks):

* :class:`L3IoMeter` times every fetch and store a rank's L3 I/O threads
  run (:class:`MeteredTier` wraps the tier the prefetcher and writer call);
* :class:`L3MetricsSource` turns the rank's :class:`~.host_tier.L3Counters`
  and the meter into one :class:`L3StepFigures` per scheduler step: the
  tokens restored and backed up since the last step, and one sample per
  I/O operation (pages, bytes, seconds) -- what SGLang's storage collector
  logs (``sglang:prefetched_tokens_total``, ``sglang:backuped_tokens_total``,
  ``sglang:prefetch_pgs``, ``sglang:prefetch_bandwidth``, ...);
* :class:`PrometheusL3Counters` exports every L3 counter and the I/O totals
  as ``sglang_cp_hicache:l3_*_total`` counters, created the way SGLang
  creates its collectors (``prometheus_client``'s default registry, so
  SGLang's multiprocess mode collects them with its own).

``prometheus_client`` (an SGLang dependency) is imported only when a
:class:`PrometheusL3Counters` is built.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "LIBRARY_PREFIX", "CounterGrowth", "IoSample", "L3IoMeter", "L3MetricsSource", "L3StepFigures", "MeteredTier",
    "PrometheusL3Counters", "counter_names", "metric_family",
]

#: The prefix of the library's own metric names.
LIBRARY_PREFIX = "sglang_cp_hicache:"
#: SGLang's storage figures count gigabytes as 2**30 bytes.
_GIB = float(1 << 30)

#: What each L3 counter means, for the exported metric's help text (a field
#: the tier gains later is exported too, with its name as help).
_COUNTER_HELP = {
    "written_pages": "Own pages whose KV and indexer objects this rank stored (new or repaired).",
    "kept_pages": "Own pages already in L3 and sound when written again (left alone).",
    "repaired_pages": "Own pages whose damaged object(s) a write replaced.",
    "write_failures": "Own pages whose KV or indexer put failed or raised.",
    "dropped_writes": "Own pages not written: too many writes queued.",
    "fetched_pages": "Own pages fetched and verified, before the MIN.",
    "rejected_pages": "Own objects found but refused (short, long, corrupt, other namespace or key).",
    "restored_pages": "Own pages put into the host pool and kept after the MIN.",
    "timeouts": "Lookups this rank gave up on at their deadline.",
    "prefetches": "Chains looked up (every rank alike).",
    "joined_requests": "Requests that waited on another request's lookup (every rank alike).",
    "restored_nodes": "Host-only nodes inserted from L3 (every rank alike).",
    "restored_tokens": "Logical tokens of those nodes (every rank alike).",
}
#: The meter's totals, exported beside the counters.
_IO_HELP = {
    "read_bytes": "Page bytes this rank fetched from L3 (KV and indexer, verified).",
    "read_seconds": "Seconds this rank's L3 fetches took (read and verify).",
    "written_bytes": "Page bytes this rank stored in L3 or found sound there (KV and indexer).",
    "write_seconds": "Seconds this rank's L3 stores took (check, write, repair).",
    "cleared_objects": "Objects of this deployment's namespaces this rank removed (clear_hicache_storage).",
}


def counter_names(counters: Mapping[str, Any]) -> dict[str, str]:
    """Field -> exported metric name for L3 counters and meter totals."""
    return {name: f"{LIBRARY_PREFIX}l3_{name}_total" for name in counters}


@dataclass(frozen=True)
class IoSample:
    """One L3 fetch or store of one rank: own pages moved, their bytes, and
    the operation's wall time."""

    pages: int
    nbytes: int
    seconds: float

    @property
    def gib_per_s(self) -> float:
        """SGLang's ``GB/s`` (2**30 bytes per second); 0 for an instant op."""
        return self.nbytes / _GIB / self.seconds if self.seconds > 0 else 0.0


class L3IoMeter:
    """Per-operation figures of one rank's L3 fetches and stores: written by
    the I/O threads, drained by the scheduler thread each step. At most
    ``max_samples`` operations wait per kind (older ones are dropped from
    the histograms, never from the totals)."""

    def __init__(self, max_samples: int = 4096) -> None:
        self._lock = threading.Lock()
        self._reads: deque[IoSample] = deque(maxlen=max_samples)
        self._writes: deque[IoSample] = deque(maxlen=max_samples)
        self._totals = dict.fromkeys(_IO_HELP, 0.0)

    def record_read(self, pages: int, nbytes: int, seconds: float) -> None:
        self._record(self._reads, "read", pages, nbytes, seconds)

    def record_write(self, pages: int, nbytes: int, seconds: float) -> None:
        self._record(self._writes, "written", pages, nbytes, seconds)

    def _record(self, samples: deque, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            samples.append(IoSample(pages, nbytes, seconds))
            self._totals[f"{kind}_bytes"] += nbytes
            self._totals["read_seconds" if kind == "read" else "write_seconds"] += seconds

    def record_cleared(self, objects: int) -> None:
        with self._lock:
            self._totals["cleared_objects"] += objects

    def drain(self) -> tuple[list[IoSample], list[IoSample]]:
        """The fetches and stores recorded since the last drain."""
        with self._lock:
            reads, writes = list(self._reads), list(self._writes)
            self._reads.clear()
            self._writes.clear()
        return reads, writes

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)


class MeteredTier:
    """A rank's tier as its prefetcher and writer call it: every page read
    (``read_page``) and stored (``store_page``) on the I/O threads is timed
    into ``meter``, one sample per operation; everything else is the tier's
    own. A page that failed (missing, refused, not stored) or raised records
    nothing."""

    def __init__(self, tier: Any, meter: L3IoMeter, clock: Callable[[], float] = time.perf_counter) -> None:
        self._tier = tier
        self._meter = meter
        self._clock = clock

    @property
    def _page_bytes(self) -> int:
        # both objects of a page (read on the I/O threads; namespaces are fixed)
        return int(self._tier.kv_ns.page_bytes) + int(self._tier.indexer_ns.page_bytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tier, name)

    def read_page(self, kv_key: str, idx_key: str, slot: int, publish: Any) -> bool:
        return self._timed(self._meter.record_read, self._tier.read_page, kv_key, idx_key, slot, publish)

    def store_page(self, kv_key: str, idx_key: str, kv: Any, idx: Any) -> bool:
        return self._timed(self._meter.record_write, self._tier.store_page, kv_key, idx_key, kv, idx)

    def _timed(self, record: Callable[[int, int, float], None], io: Callable[..., bool], *args: Any) -> bool:
        """``io(*args)``, recorded as one page of I/O (with its seconds) when it succeeds."""
        start = self._clock()
        ok = io(*args)
        if ok:
            record(1, self._page_bytes, self._clock() - start)
        return ok


@dataclass
class L3StepFigures:
    """What one rank's L3 did since the last step, in SGLang's units.

    ``restored_tokens``: logical tokens inserted from L3 (every rank alike,
    SGLang's ``prefetched`` tokens); ``backed_up_tokens``: tokens of this
    rank's own pages stored or found sound in L3; ``dropped_backup_tokens``:
    tokens of own pages whose write was dropped (queue full); ``reads`` /
    ``writes``: one sample per fetch / store operation."""

    restored_tokens: int = 0
    backed_up_tokens: int = 0
    dropped_backup_tokens: int = 0
    reads: list[IoSample] = field(default_factory=list)
    writes: list[IoSample] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.restored_tokens or self.backed_up_tokens or self.dropped_backup_tokens
                    or self.reads or self.writes)


class L3MetricsSource:
    """Deltas of one rank's L3 counters and meter, one :meth:`step` at a time
    (call it from the scheduler thread only)."""

    def __init__(self, counters: Any, meter: L3IoMeter, page_size: int) -> None:
        self.counters = counters
        self.meter = meter
        self.page_size = int(page_size)
        self._last = dict(counters.as_dict())

    def snapshot(self) -> dict[str, float]:
        """Every counter and meter total now (field -> value)."""
        return {**self.counters.as_dict(), **self.meter.totals()}

    def step(self) -> L3StepFigures:
        now = self.counters.as_dict()

        def delta(name: str) -> int:
            return int(now.get(name, 0) - self._last.get(name, 0))

        backed = delta("written_pages") + delta("kept_pages")
        figures = L3StepFigures(
            restored_tokens=delta("restored_tokens"), backed_up_tokens=backed * self.page_size,
            dropped_backup_tokens=delta("dropped_writes") * self.page_size,
        )
        figures.reads, figures.writes = self.meter.drain()
        self._last = now
        return figures


#: Process-wide metric families by (class, label names) and metric name (a
#: name is registered once per process: ranks simulated in one process
#: share its family, each with its own label values).
_FAMILIES: dict[tuple[Any, tuple[str, ...]], dict[str, Any]] = {}
_FAMILIES_LOCK = threading.Lock()


def metric_family(cls: Any, labelnames: tuple[str, ...], metric: str, help_text: str, **kwargs: Any) -> Any:
    """The process's ``cls`` family named ``metric``, built on first use."""
    with _FAMILIES_LOCK:
        families = _FAMILIES.setdefault((cls, labelnames), {})
        if metric not in families:
            families[metric] = cls(name=metric, documentation=help_text, labelnames=labelnames, **kwargs)
        return families[metric]


class CounterGrowth:
    """Counter series fed from monotonic totals (Prometheus counters only
    grow): :meth:`publish` adds what each total grew by since the last call."""

    def __init__(self, series: Mapping[str, Any]) -> None:
        self._series = dict(series)
        self._last: dict[str, float] = {}

    def publish(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            series = self._series.get(name)
            grown = value - self._last.get(name, 0)
            if series is not None and grown > 0:
                series.inc(grown)
            self._last[name] = value


class PrometheusL3Counters:
    """The library's L3 counters of one rank as Prometheus counters,
    ``sglang_cp_hicache:l3_<field>_total`` (field: an :class:`L3Counters`
    field or an I/O total: ``read_bytes``, ``read_seconds``,
    ``written_bytes``, ``write_seconds``, ``cleared_objects``), labelled
    like SGLang's storage metrics (``labels``). :meth:`publish` adds what
    each value grew by since the last call. ``counter_cls``: a class with
    ``prometheus_client.Counter``'s interface (SGLang's stat-logger hook)."""

    def __init__(self, labels: Mapping[str, Any], fields: Mapping[str, Any], counter_cls: Any = None) -> None:
        if counter_cls is None:
            from prometheus_client import Counter as counter_cls
        self.labels = {k: str(v) for k, v in labels.items()}
        self.names = counter_names(fields)
        self._growth = CounterGrowth({
            name: metric_family(counter_cls, tuple(self.labels), metric,
                                _COUNTER_HELP.get(name) or _IO_HELP.get(name) or name).labels(**self.labels)
            for name, metric in self.names.items()
        })

    def publish(self, values: Mapping[str, float]) -> None:
        self._growth.publish(values)

