"""A dependency-free progress bar on stderr (the launcher draws it)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Redraws one line on a terminal; elsewhere prints a line every 10%."""

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._closed = False

    def update(self, done: int) -> None:
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
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"{prefix}{self.label} [{bar}] {self.done}/{self.total} requests {elapsed:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self._draw("\r")
            self.stream.write("\n")
            self.stream.flush()
