"""``python -m sglang_cp_hicache simulate`` on SGLang 0.5.23's sharded stack:
the release is detected, every KV and indexer byte goes through this
library's kernels with the real cp_size, and the JSON says so."""

from __future__ import annotations

import json
import subprocess

from tests.sim.simrun import ROOT, sim_command, sim_env


def test_simulate_on_the_sharded_pool_through_the_library_kernels(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        sim_command("--cp-size", "2", "--requests", "30", "--json", str(out)),
        cwd=ROOT, env=sim_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["sglang_version"] == "0.5.23" and s["copy_path"] == "library"
    assert s["corrupted_pages"] == 0 and s["restored_pages_verified"] > 0
    assert s["indexer_pages_verified"] == s["verified_pages"] > 0
    assert s["ranks_agree"]
    copies = s["copies"]
    assert copies["cp_size"] == 2
    assert min(copies["kv_backup_calls"], copies["kv_load_calls"],
               copies["indexer_backup_calls"], copies["indexer_load_calls"]) > 0
    assert all(c["copy_path"] == "library" and c["submit_calls"] > 0 for c in s["copy_path_cpu_seconds_per_rank"])


def test_compare_non_cp_is_refused_on_0523():
    proc = subprocess.run(
        sim_command("--cp-size", "2", "--compare-non-cp"), cwd=ROOT, env=sim_env(),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "--compare-non-cp needs --sglang 0.5.18" in proc.stderr
