"""The Grafana dashboard shipped in docs/grafana: every PromQL expression
names only metrics the library exports (a renamed metric fails here), every
library counter and gauge has a panel, and the file is a dashboard Grafana
loads (panels with targets on the templated Prometheus datasource)."""

from __future__ import annotations

import json
import pathlib
import re

from sglang_cp_hicache.l3.host_tier import L3Counters
from sglang_cp_hicache.library_metrics import COUNTER_HELP, GAUGE_HELP, exported_metric_names

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "sglang-cp-hicache.json"
#: A library metric name inside PromQL (names may hold colons).
_NAME = re.compile(r"sglang_cp_hicache:[A-Za-z0-9_:]+")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def _named(dashboard: dict) -> set[str]:
    return {name for expr in _expressions(dashboard) for name in _NAME.findall(expr)}


def test_every_expression_names_only_exported_metrics():
    exported = exported_metric_names(L3Counters().as_dict())
    for expr in _expressions(_dashboard()):
        names = _NAME.findall(expr)
        assert names, f"expression names no library metric: {expr}"
        assert set(names) <= exported, f"{expr}: not exported: {sorted(set(names) - exported)}"


def test_every_library_counter_and_gauge_has_a_panel():
    named = _named(_dashboard())
    missing = {f"sglang_cp_hicache:{n}_total" for n in COUNTER_HELP} | {f"sglang_cp_hicache:{n}" for n in GAUGE_HELP}
    assert not missing - named, sorted(missing - named)
    assert any(n.startswith("sglang_cp_hicache:l3_") for n in named)  # the L3 counters too


def test_it_is_a_grafana_dashboard_on_a_templated_prometheus_source():
    d = _dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    kinds = {v["name"]: v["type"] for v in d["templating"]["list"]}
    assert kinds["datasource"] == "datasource"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert all(t["refId"] and t["expr"] for t in p["targets"]), p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
