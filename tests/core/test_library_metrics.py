"""The library's live counters as Prometheus metrics (release-neutral part):
names as SGLang names its own, deltas published once per step, gauges set."""

from __future__ import annotations

from functools import partial

import pytest

from sglang_cp_hicache.library_metrics import (
    COUNTER_HELP, GAUGE_HELP, RELEASE_COUNTERS, LibraryFigures, PrometheusLibraryMetrics, exported_metric_names,
)

prometheus_client = pytest.importorskip("prometheus_client")

LABELS = {"storage_backend": "none", "tp_rank": 1, "dp_rank": 0, "pp_rank": 0, "pp_size": 1,
          "attn_cp_rank": 1, "attn_cp_size": 2}


def _metrics(registry, counters=RELEASE_COUNTERS["0.5.23"]):
    return PrometheusLibraryMetrics(
        LABELS, counters, counter_cls=partial(prometheus_client.Counter, registry=registry),
        gauge_cls=partial(prometheus_client.Gauge, registry=registry),
    )


def _value(registry, name):
    return registry.get_sample_value(name, {k: str(v) for k, v in LABELS.items()})


def test_counters_grow_by_each_steps_delta_and_gauges_follow_the_rank():
    registry = prometheus_client.CollectorRegistry()
    metrics = _metrics(registry)
    metrics.publish(LibraryFigures({"backups": 3, "load_back_tokens": 128},
                                   {"host_pages_in_use": 5, "host_pages_capacity": 8}))
    metrics.publish(LibraryFigures({"backups": 7, "load_back_tokens": 128}, {"host_pages_in_use": 2}))
    assert _value(registry, "sglang_cp_hicache:backups_total") == 7
    assert _value(registry, "sglang_cp_hicache:load_back_tokens_total") == 128
    assert _value(registry, "sglang_cp_hicache:backup_failures_total") == 0  # exported before it moves
    assert _value(registry, "sglang_cp_hicache:host_pages_in_use") == 2
    assert _value(registry, "sglang_cp_hicache:host_pages_capacity") == 8


def test_a_release_exports_only_its_counters_and_unknown_ones_are_refused():
    registry = prometheus_client.CollectorRegistry()
    _metrics(registry, RELEASE_COUNTERS["0.5.18"])
    text = prometheus_client.generate_latest(registry).decode()
    assert "sglang_cp_hicache:load_backs_declined_total" in text
    assert "sglang_cp_hicache:backups_kept_by_host_room_total" not in text
    with pytest.raises(ValueError, match="unknown library counters"):
        _metrics(prometheus_client.CollectorRegistry(), ("backups", "renamed"))


def test_every_exported_name_follows_sglangs_scheme():
    names = exported_metric_names({"written_pages": 0})
    assert {f"sglang_cp_hicache:{n}_total" for n in COUNTER_HELP} <= names
    assert {f"sglang_cp_hicache:{n}" for n in GAUGE_HELP} <= names
    assert {"sglang_cp_hicache:l3_written_pages_total", "sglang_cp_hicache:l3_read_bytes_total"} <= names
    assert all(set(c) <= set(COUNTER_HELP) for c in RELEASE_COUNTERS.values())
