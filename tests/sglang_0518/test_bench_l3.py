"""bench/bench_l3.py runs end to end on a few pages: every path reads back
the bytes it wrote (the bench asserts it), and the JSON carries the figures
the README and results.md quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow(20)
def test_bench_l3_smoke(tmp_path):
    out = tmp_path / "l3.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_l3.py"), "--pages", "3", "--rounds", "2", "--threads", "2",
         "--prefix-tokens", "640", "--cp", "1,2", "--dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for kind in ("kv", "indexer"):
        row = result[kind]
        for name in ("raw", "hicachefile", "library"):
            for op in ("write", "read"):
                assert row[f"{name}_{op}_GBps"] > 0 and len(row[f"{name}_{op}_GBps_rounds"]) == 2
            assert row[f"{name}_read_cold_GBps"] > 0
        assert row["library_over_hicachefile_read"] > 0 and row["library_over_raw_write"] > 0
    assert result["prefix"]["pages_per_rank_cp2"] == 5 and result["prefix"]["restore_GBps_cp1"] > 0
    assert "xxh3_64_GBps" in result["checksums"]
