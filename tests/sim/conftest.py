"""Fixtures of the simulator's CLI tests that start no rank."""

from __future__ import annotations

import pytest

from sglang_cp_hicache.sim import launcher
from sglang_cp_hicache.sim.config import SimConfig


@pytest.fixture
def captured_launch(monkeypatch) -> list[SimConfig]:
    """Record the SimConfig a run would launch with, then stop it (exit 1)."""
    seen: list[SimConfig] = []

    def fake(config, requests, **kwargs):
        seen.append(config)
        return launcher.LaunchResult(label="fake", exit_codes={0: 1})

    monkeypatch.setattr(launcher, "launch", fake)
    return seen
