"""A rank process's scrape of the library's metrics (``--metrics``): what
its ``/metrics`` page shows of ``sglang_cp_hicache:*``, read back from the
Prometheus text exposition of the default registry, as a scraper reads it."""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.l3.metrics import LIBRARY_PREFIX

__all__ = ["scrape_library_metrics"]


def scrape_library_metrics() -> dict[str, Any]:
    """``{"samples": {name: value}, "labels": {...}}`` of this process's
    library series (one rank per process: one series per name). Counter
    ``_created`` timestamps are left out."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    labels: dict[str, str] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name.startswith(LIBRARY_PREFIX) and not sample.name.endswith("_created"):
                samples[sample.name] = float(sample.value)
                labels = dict(sample.labels)
    return {"samples": samples, "labels": labels}
