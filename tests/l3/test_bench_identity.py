"""bench/bench_identity.py builds its sparse checkpoint, times the
fingerprint, writes what docs/results.md renders and leaves no layout behind."""

from __future__ import annotations

import json

from sglang_cp_hicache.l3 import fingerprint
from tests.helpers.bench_scripts import bench_module


def test_the_identity_bench_writes_its_figures_and_removes_its_layout(tmp_path, capsys):
    out = tmp_path / "identity.json"
    with bench_module("bench_identity", "_bench_identity") as module:
        module.main(["--shards", "2", "--shard-gb", "0.01", "--rounds", "1", "--dir", str(tmp_path),
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"] == "python bench/bench_identity.py --shards 2 --shard-gb 0.01 --rounds 1"
    assert result["layout"]["shards"] == 2 and result["layout"]["apparent_bytes"] > 2 * 10**7
    assert result["read_calls"] == 2 * (2 + fingerprint.SAMPLES) + 3  # two shards, three JSON files
    assert result["cold_s"] > 0 and result["warm_s"] > 0 and result["cached_s"] >= 0
    assert [p.name for p in tmp_path.iterdir()] == ["identity.json"]
    assert json.loads(capsys.readouterr().out) == result
