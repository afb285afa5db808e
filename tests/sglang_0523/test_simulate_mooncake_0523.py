"""``simulate --trace`` on the committed Mooncake slice with SGLang 0.5.23
(library copies, with L3), against a plain 0.5.23 stack with N x the pages
(--compare-non-cp): the same whole check as the 0.5.18 suite's."""

from __future__ import annotations

import pytest

from tests.sim.mooncake_run import check_slice_run, run_slice


@pytest.mark.slow(25)
def test_the_mooncake_slice_replays_bit_exact_and_reports_every_tier_against_the_ideal(tmp_path):
    summary, proc, png = run_slice(tmp_path, "--copy", "library")
    assert summary["sglang_version"] == "0.5.23" and summary["copy_path"] == "library"
    assert summary["non_cp"]["device_pages"] == 48  # N x D allocatable pages in one plain pool
    check_slice_run(summary, proc, png)
