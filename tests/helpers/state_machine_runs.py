"""Run a CP cache state machine (either release) under the chosen hypothesis
profile, and report its step count for ``make soak`` (``tests/soak``).

The profile is ``$HYPOTHESIS_PROFILE`` (``ci`` by default); under ``dev``,
``$STATE_MACHINE_EXAMPLES`` sets the examples and the step floor follows
(half the full step count: hypothesis runs close to the full count per
example). Every run prints its step count; when ``$STATE_MACHINE_REPORT``
names a file, one JSON line per run is appended there, failed runs included
(``steps``, the release's extra counts, ``passed``, ``seconds``), and no
example is saved: a soak run is repeated by its seed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

__all__ = ["chosen_profile", "run_and_report"]


def chosen_profile(profiles: dict[str, dict]) -> tuple[str, dict]:
    """(profile name, a copy of its entry in ``profiles``; ``ci``'s for an unknown name)."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    profile = dict(profiles.get(name, profiles["ci"]))
    examples = os.environ.get("STATE_MACHINE_EXAMPLES")
    if name == "dev" and examples:
        profile["examples"] = int(examples)
        profile["min_total"] = profile["examples"] * profile["steps"] // 2
    return name, profile


def run_and_report(
    machine: type[RuleBasedStateMachine], name: str, profile: dict, steps: dict[str, int],
    extra: Callable[[], dict[str, int]] = dict, note: Callable[[], str] = str,
) -> None:
    """Run ``machine`` with ``profile``'s examples and steps per example, then
    print ``steps["total"]`` (and ``note()``) and append the JSON line,
    ``extra()`` added; the report is written whether the run passed or not."""
    start, passed = time.monotonic(), False
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=profile["examples"],
                stateful_step_count=profile["steps"],
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=name == "ci",
                # A soak run is repeated by its seed, not by a saved example.
                database=None if os.environ.get("STATE_MACHINE_REPORT") else settings.default.database,
            ),
        )
        passed = True
    finally:
        seconds = time.monotonic() - start
        print(f"state machine steps: {steps['total']} ({note()}{'passed' if passed else 'FAILED'}, {seconds:.0f} s)")
        path = os.environ.get("STATE_MACHINE_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"steps": steps["total"], **extra(), "passed": passed,
                                    "seconds": round(seconds, 1)}) + "\n")
