"""``simulate --engine scheduler`` on SGLang 0.5.23: a synthetic workload
through the real Scheduler at CP 2 in PD-prefill mode (its sharded
allocator refuses decode) on the library's copy path: exit 0, the summary's
engine fields, every host hit loaded back."""

from __future__ import annotations

import json

import pytest

from tests.helpers.engine_checks import check_scheduler_summary
from tests.sim.simrun import simulate
from tests.sim.test_engine_scheduler import SMALL_RUN
from tests.sim.test_cli_checks import run_cli


@pytest.mark.slow(40)
def test_scheduler_engine_replays_the_synthetic_chat_through_sglangs_pd_prefill_loop(tmp_path):
    out = tmp_path / "s.json"
    proc, _ = simulate(*SMALL_RUN, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    check_scheduler_summary(s, version="0.5.23", requests=30, loop="event_loop_normal_disagg_prefill")
    assert s["copy_path"] == "library"


def test_decode_tokens_at_cp_over_1_exit_2(capsys, monkeypatch):
    from sglang_cp_hicache.sim import engine_scheduler

    monkeypatch.setattr(engine_scheduler, "replay_through_scheduler", lambda *a, **k: pytest.fail("started"))
    assert run_cli("--engine", "scheduler", "--max-new-tokens", "4") == 2
    assert "--max-new-tokens must be 1 on SGLang 0.5.23 at --cp-size > 1" in capsys.readouterr().err
