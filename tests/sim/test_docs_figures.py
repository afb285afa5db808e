"""Figures the docs quote from committed simulator results match the JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serving_path_quotes_the_identical_hit_counts_of_the_committed_runs():
    text = " ".join((ROOT / "docs" / "serving-path.md").read_text().split())
    for cp in (4, 8):
        result = json.loads((ROOT / "bench" / "results" / f"sim_cp{cp}.json").read_text())
        same, total = result["comparison"]["requests_with_identical_hits"], result["requests"]
        assert re.search(rf"\b{same} of {total}( requests)? at CP {cp}\b", text), (cp, same, total)
