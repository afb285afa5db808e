"""One line per check: its level, what was checked, why, and what to do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["EXIT_FAIL", "EXIT_OK", "FAIL", "Finding", "LEVELS", "OK", "WARN", "exit_status", "render"]

OK, WARN, FAIL = "OK", "WARN", "FAIL"
LEVELS = (OK, WARN, FAIL)
EXIT_OK, EXIT_FAIL = 0, 2


@dataclass(frozen=True)
class Finding:
    """The outcome of one check: ``level`` (OK, WARN or FAIL), ``what`` (the
    thing checked, e.g. ``L3 directory``) and ``text`` (what was found and,
    for WARN and FAIL, what to do)."""

    level: str
    what: str
    text: str

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")

    def line(self) -> str:
        return f"{self.level:<4} {self.what}: {self.text}"


def render(findings: Iterable[Finding]) -> str:
    return "\n".join(f.line() for f in findings)


def exit_status(findings: Iterable[Finding]) -> int:
    """2 when any check failed, else 0 (warnings do not fail the check)."""
    return EXIT_FAIL if any(f.level == FAIL for f in findings) else EXIT_OK
