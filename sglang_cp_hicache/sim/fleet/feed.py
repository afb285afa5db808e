"""The channel between a fleet's coordinator and one deployment's ranks.

Each deployment's rank processes run a ``simulate`` launched with a feed
directory holding named pipes (FIFOs) that the coordinator created:

* ``rank<R>.feed`` (coordinator -> rank R): one request index a line, then
  ``end``; every rank of the deployment reads the same indices, so all
  serve the same requests in the same order and meet at the same
  collectives;
* ``events`` (ranks -> coordinator): ``ready`` (rank 0, replay about to
  start), ``start I`` (rank 0 began serving request I) and
  ``done R I DEVICE HOST L3 VERIFIED CORRUPTED`` (rank R finished request I:
  hit tokens per tier as rank 0 matched them, owned pages checked, of them
  corrupted).

The coordinator opens every pipe read-write: a rank's open never waits for
the other side, a rank never reads end-of-file before ``end``, and the
coordinator's writes never fail on a deployment that died. Event lines are
far shorter than ``PIPE_BUF``, so the ranks' writes to the one events pipe
never interleave.
"""

from __future__ import annotations

import os
import select
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Optional

__all__ = ["EVENTS", "END", "DoneEvent", "EventReader", "FeedWriter", "RankFeed", "feed_path", "make_feed_dir"]

EVENTS = "events"
END = "end"


def feed_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.feed")


def make_feed_dir(directory: str, cp_size: int) -> None:
    """Create one deployment's FIFOs in ``directory`` (which must exist)."""
    for rank in range(cp_size):
        os.mkfifo(feed_path(directory, rank), 0o600)
    os.mkfifo(os.path.join(directory, EVENTS), 0o600)


@dataclass(frozen=True)
class DoneEvent:
    """One rank finished one request."""

    rank: int
    index: int
    device: int  # hit tokens per tier (rank 0's match; every rank matches alike)
    host: int
    l3: int
    verified: int  # this rank's owned pages checked
    corrupted: int  # of them, not bit-exact


class FeedWriter:
    """The coordinator's end of one deployment: indices out, events in."""

    def __init__(self, directory: str, cp_size: int) -> None:
        self._feeds = [os.open(feed_path(directory, r), os.O_RDWR) for r in range(cp_size)]
        self.events = EventReader(os.open(os.path.join(directory, EVENTS), os.O_RDWR | os.O_NONBLOCK))

    def send(self, index: int) -> None:
        self._write(f"{index}\n".encode())

    def end(self) -> None:
        self._write(f"{END}\n".encode())

    def _write(self, line: bytes) -> None:
        for fd in self._feeds:
            os.write(fd, line)  # a line or two in a 64 KiB pipe: never blocks

    def close(self) -> None:
        for fd in self._feeds:
            os.close(fd)
        self._feeds = []
        self.events.close()


class EventReader:
    """Parse the lines of one deployment's events pipe (non-blocking)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._partial = b""

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[tuple[str, ...]]:
        """Every whole event line available now, split into words."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        return [tuple(line.decode().split()) for line in lines if line]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def wait_readable(readers: list[EventReader], timeout: float) -> list[EventReader]:
    ready, _, _ = select.select([r for r in readers if r.fd >= 0], [], [], timeout)
    return ready


class RankFeed:
    """A rank's end: the indices it serves, and its events."""

    def __init__(self, directory: str, rank: int) -> None:
        self.rank = rank
        self._feed: IO[str] = open(feed_path(directory, rank), encoding="ascii")
        self._events = os.open(os.path.join(directory, EVENTS), os.O_WRONLY)

    def indices(self) -> Iterator[int]:
        """Request indices in the order the coordinator released them, until ``end``."""
        for line in self._feed:
            word = line.strip()
            if word == END:
                return
            yield int(word)
        raise RuntimeError("the fleet's request feed closed without 'end' (the coordinator is gone)")

    def ready(self) -> None:
        if self.rank == 0:
            self._event("ready")

    def started(self, index: int) -> None:
        if self.rank == 0:
            self._event(f"start {index}")

    def done(self, index: int, device: int, host: int, l3: int, verified: int, corrupted: int) -> None:
        self._event(f"done {self.rank} {index} {device} {host} {l3} {verified} {corrupted}")

    def _event(self, line: str) -> None:
        os.write(self._events, (line + "\n").encode())

    def close(self) -> None:
        self._feed.close()
        os.close(self._events)


def parse_done(words: tuple[str, ...]) -> Optional[DoneEvent]:
    """A ``done`` event's fields (None for any other event)."""
    if not words or words[0] != "done" or len(words) != 8:
        return None
    return DoneEvent(*(int(w) for w in words[1:]))


def feed_dir_for(root: str, name: str) -> str:
    path = Path(root, name)
    path.mkdir(parents=True)
    return os.fspath(path)
