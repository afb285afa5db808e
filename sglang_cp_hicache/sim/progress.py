"""Dependency-free progress on stderr (the launcher draws it): the ranks'
start-up as it happens, then a bar over the replay with its own clock and an
estimate of the time left."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["ProgressBar", "StartupProgress", "format_seconds"]

#: Start-up phases a rank reports, in order, and how the launcher says them.
STARTUP_PHASES = {
    "imported": "SGLang imported",
    "joined": "joined the group",
    "built": "stacks built",
}


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StartupProgress:
    """One line each time every process has reached a start-up phase."""

    def __init__(self, label: str, processes: int, stream: Optional[TextIO] = None,
                 show: bool = True) -> None:
        self.label = label
        self.processes = processes
        self.stream = stream if stream is not None else sys.stderr
        self.show = show
        self.start = time.perf_counter()
        self._ranks: dict[str, set[int]] = {phase: set() for phase in STARTUP_PHASES}
        self.done_at: Optional[float] = None  # seconds from start to the last "built"
        self._say(f"starting {processes} process{'es' if processes > 1 else ''} "
                  "(each imports SGLang, joins the group and builds its stack)")

    def _say(self, text: str) -> None:
        if self.show:
            self.stream.write(f"{self.label}: {text}\n")
            self.stream.flush()

    def update(self, rank: int, phase: str) -> None:
        ranks = self._ranks.get(phase)
        if ranks is None or rank in ranks:
            return
        ranks.add(rank)
        if len(ranks) == self.processes:
            elapsed = time.perf_counter() - self.start
            if phase == "built":
                self.done_at = elapsed
            self._say(f"{self.processes}/{self.processes} {STARTUP_PHASES[phase]} after {elapsed:.1f} s")


class ProgressBar:
    """Redraws one line on a terminal; elsewhere prints a line every 10%.
    Its clock starts at the first update (the replay's first request), so the
    elapsed time and the estimate leave start-up out."""

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start: Optional[float] = None
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._closed = False

    def begin(self) -> None:
        """The replay starts now (every stack is built)."""
        if self.start is None:
            self.start = time.perf_counter()

    def update(self, done: int) -> None:
        self.begin()
        self.done = min(done, self.total)
        if self._tty:
            self._draw("\r")
            return
        decile = self.done * 10 // self.total
        if decile != self._last_decile:
            self._last_decile = decile
            self._draw("")
            self.stream.write("\n")
        self.stream.flush()

    def _draw(self, prefix: str) -> None:
        filled = self.done * self.width // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start if self.start is not None else 0.0
        tail = ""
        if 0 < self.done < self.total:
            tail = f", about {format_seconds(elapsed * (self.total - self.done) / self.done)} left"
        text = f"{self.label} replay [{bar}] {self.done}/{self.total} requests {format_seconds(elapsed)}{tail}"
        self.stream.write(prefix + text + ("\x1b[K" if self._tty else ""))  # a shorter line clears the old tail
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty and self.start is not None:
            self._draw("\r")
            self.stream.write("\n")
            self.stream.flush()
