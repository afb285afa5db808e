"""The channel between a fleet's coordinator and one deployment's ranks.

Each deployment runs a ``simulate`` launched with a feed directory holding
named pipes (FIFOs) that the coordinator created, one feed per reader:

* ``rank<R>.feed`` (coordinator -> reader R): one request index a line,
  then ``end``. On the loop engine every rank is a reader and reads the
  same indices, so all serve the same requests in the same order and meet
  at the same collectives. On the scheduler engine the one reader (R = 0)
  is the ``simulate`` process that drives SGLang's scheduler
  (:class:`ParentFeed`): its ranks take requests from SGLang's input socket;
* ``events`` (deployment -> coordinator): ``ready`` (replay about to
  start), ``start I`` (the deployment took request I: the loop engine's
  rank 0 began serving it; the scheduler engine submitted it to SGLang) and
  ``done R I DEVICE HOST L3 VERIFIED CORRUPTED`` (rank R finished request I:
  hit tokens per tier as rank 0 matched them, owned pages checked, of them
  corrupted). The scheduler engine's parent writes one ``done`` per request
  as rank 0: its VERIFIED counts the request's hit pages, each checked on
  the rank that owns it before the request's first forward (which rank
  checked how many is not reported per request), and CORRUPTED is 0 (a
  mismatch fails the deployment's run instead).

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

__all__ = ["EVENTS", "END", "DoneEvent", "EventReader", "FeedWriter", "ParentFeed", "RankFeed", "feed_path",
           "make_feed_dir"]

EVENTS = "events"
END = "end"


def feed_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.feed")


def make_feed_dir(directory: str, readers: int) -> None:
    """Create one deployment's FIFOs in ``directory`` (which must exist): a
    feed for each of its ``readers`` (a FIFO nobody reads fills and blocks
    the coordinator) and the events pipe."""
    for rank in range(readers):
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

    def __init__(self, directory: str, readers: int) -> None:
        self._feeds = [os.open(feed_path(directory, r), os.O_RDWR) for r in range(readers)]
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


class _EventSink:
    """A deployment's writes to its events pipe, as rank ``rank``."""

    def __init__(self, directory: str, rank: int) -> None:
        self.rank = rank
        self._fd = os.open(os.path.join(directory, EVENTS), os.O_WRONLY)

    def ready(self) -> None:
        if self.rank == 0:
            self._event("ready")

    def started(self, index: int) -> None:
        if self.rank == 0:
            self._event(f"start {index}")

    def done(self, index: int, device: int, host: int, l3: int, verified: int, corrupted: int) -> None:
        self._event(f"done {self.rank} {index} {device} {host} {l3} {verified} {corrupted}")

    def _event(self, line: str) -> None:
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class RankFeed(_EventSink):
    """A rank's end (loop engine): the indices it serves, and its events."""

    def __init__(self, directory: str, rank: int) -> None:
        self._feed: IO[str] = open(feed_path(directory, rank), encoding="ascii")
        super().__init__(directory, rank)

    def indices(self) -> Iterator[int]:
        """Request indices in the order the coordinator released them, until ``end``."""
        for line in self._feed:
            word = line.strip()
            if word == END:
                return
            yield int(word)
        raise RuntimeError("the fleet's request feed closed without 'end' (the coordinator is gone)")

    def close(self) -> None:
        self._feed.close()
        super().close()


class ParentFeed(_EventSink):
    """The scheduler engine's end: the ``simulate`` parent reads the indices
    without blocking (its wait serves SGLang's ranks meanwhile) and writes
    every event as rank 0."""

    def __init__(self, directory: str) -> None:
        self._feed = os.open(feed_path(directory, 0), os.O_RDONLY | os.O_NONBLOCK)
        super().__init__(directory, 0)
        self._partial = b""
        self.ended = False

    def fileno(self) -> int:
        return self._feed

    def read(self) -> list[int]:
        """The indices released since the last call, in order (``ended`` set once ``end`` came)."""
        try:
            chunk = os.read(self._feed, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk and not self.ended:  # the coordinator holds its end open until it ends us
            raise RuntimeError("the fleet's request feed closed without 'end' (the coordinator is gone)")
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            word = line.decode().strip()
            if word == END:
                self.ended = True
            elif word and not self.ended:
                out.append(int(word))
        return out

    def done(self, index: int, device: int, host: int, l3: int, verified: int, corrupted: int = 0) -> None:
        """As rank 0 for the whole deployment (``corrupted`` 0: a mismatch fails the run instead)."""
        super().done(index, device, host, l3, verified, corrupted)

    def close(self) -> None:
        os.close(self._feed)
        super().close()


def parse_done(words: tuple[str, ...]) -> Optional[DoneEvent]:
    """A ``done`` event's fields (None for any other event)."""
    if not words or words[0] != "done" or len(words) != 8:
        return None
    return DoneEvent(*(int(w) for w in words[1:]))


def feed_dir_for(root: str, name: str) -> str:
    path = Path(root, name)
    path.mkdir(parents=True)
    return os.fspath(path)
