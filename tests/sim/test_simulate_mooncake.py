"""``simulate --trace`` on the committed Mooncake slice with SGLang 0.5.18:
the ideal, hits per tier (device, host, L3), the non-CP baseline's hits and
capacity_efficiency, bytes and GB/s, start-up progress, the plot -- one run
(tests/sim/mooncake_run.py; the 0.5.23 suite runs the same check)."""

from __future__ import annotations

import pytest

from tests.sim.mooncake_run import check_slice_run, run_slice


@pytest.mark.slow(25)
def test_the_mooncake_slice_replays_bit_exact_and_reports_every_tier_against_the_ideal(tmp_path):
    summary, proc, png = run_slice(tmp_path)
    assert summary["sglang_version"] == "0.5.18"
    check_slice_run(summary, proc, png)
