"""Each simulator process's stdout/stderr, kept in a file with no name.

A rank's output (SGLang's import chatter, warnings, tracebacks) goes to an
anonymous temporary file the launcher creates and hands to the rank as an
open file descriptor. Nothing has a path while the run lasts, so a launcher
killed by SIGKILL leaves nothing on disk: the kernel frees the file when the
last process holding it exits. Only when a run fails does the launcher copy
the logs into a directory it names in its report.
"""

from __future__ import annotations

import os
import tempfile
from multiprocessing import reduction
from typing import BinaryIO, Optional

__all__ = ["InheritedFd", "RankLog", "save_logs"]

_COPY_CHUNK = 1 << 20


def _rebuild_fd(dup: object) -> "InheritedFd":
    return InheritedFd(dup.detach())  # type: ignore[attr-defined]


class InheritedFd:
    """A file descriptor that travels to a ``spawn`` child as an argument.

    Pickling it while a ``multiprocessing`` Process starts duplicates the fd
    into the child (the mechanism ``Pipe`` ends use); the child gets its own
    descriptor of the same open file.
    """

    def __init__(self, fd: int) -> None:
        if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
            raise ValueError(f"fd must be a non-negative int, got {fd!r}")
        self.fd = fd

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


class RankLog:
    """One process's log: an unnamed temporary file, read back by the launcher."""

    def __init__(self, name: str) -> None:
        self.name = name  # "rank0", "noncp": the file name if the log is kept
        self._file: Optional[BinaryIO] = tempfile.TemporaryFile(prefix="sglang-cp-hicache-")

    def for_child(self) -> InheritedFd:
        return InheritedFd(self._handle().fileno())

    def _handle(self) -> BinaryIO:
        if self._file is None:
            raise ValueError(f"the log of {self.name} is closed")
        return self._file

    def copy_to(self, path: str) -> None:
        """Write everything logged so far to ``path``. Reads with ``pread``:
        the child shares the file offset and may still be writing."""
        fd = self._handle().fileno()
        offset = 0
        with open(path, "wb") as out:
            while True:
                chunk = os.pread(fd, _COPY_CHUNK, offset)
                if not chunk:
                    break
                out.write(chunk)
                offset += len(chunk)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def save_logs(logs: list[RankLog]) -> str:
    """Copy every log into a new directory (``<name>.log``); return its path."""
    log_dir = tempfile.mkdtemp(prefix="sglang-cp-hicache-sim-")
    for log in logs:
        log.copy_to(os.path.join(log_dir, f"{log.name}.log"))
    return log_dir
