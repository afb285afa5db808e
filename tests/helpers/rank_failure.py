"""Fail-fast collectives for CP ranks simulated as threads of one process.

Ranks in separate processes learn of a dead peer when its sockets close. Rank
threads do not: a rank whose stack construction raises leaves its group open,
and its peers wait in the next collective for the whole gloo time-out (60 s),
after which the only error anyone sees is a peer's time-out.

:class:`FailFastGroup` wraps a rank's gloo group. Every blocking collective
checks a :class:`RankFailure` shared by the ranks before it starts and while
it waits, and raises :class:`PeerRankFailed` as soon as another rank has
recorded a failure. The first recorded error is the one to report.

A gloo group whose collective is still in flight cannot be destroyed (its
destructor waits for the operation's own time-out), so
:func:`release_groups` drops the groups in an order that lets every pending
operation end first: a released group's sockets close, which ends its peers'
pending receives with an error.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

__all__ = ["FailFastGroup", "PeerRankFailed", "RankFailure", "release_groups"]

#: How long one wait on a pending collective lasts before the failure flag is
#: read again: the delay with which a peer's failure is noticed.
POLL = datetime.timedelta(milliseconds=20)

# Groups whose collective never ended while being released: kept referenced so
# that no destructor blocks a later garbage collection (gloo ends the
# operation by its own time-out, in the background).
_STRANDED: list[dist.ProcessGroup] = []


class PeerRankFailed(RuntimeError):
    """This rank stopped waiting in a collective because another rank failed."""


@dataclass
class RankFailure:
    """The first failure among a group of rank threads (thread-safe)."""

    cp_rank: Optional[int] = None
    error: Optional[BaseException] = None
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, cp_rank: int, error: BaseException) -> None:
        """Keep ``error`` unless an earlier failure was recorded."""
        with self._lock:
            if self.cp_rank is None:
                self.cp_rank, self.error = cp_rank, error
                self._event.set()

    @property
    def failed(self) -> bool:
        return self._event.is_set()


def _blocking(name: str) -> Callable[..., dist.Work]:
    """A FailFastGroup method running the inner group's collective ``name``
    through ``_collective`` (given up once a peer has failed)."""

    def collective(self: "FailFastGroup", *args: Any, **kwargs: Any) -> dist.Work:
        return self._collective(name, *args, **kwargs)

    collective.__name__ = name
    return collective


class FailFastGroup(dist.ProcessGroup):
    """A rank's gloo group whose collectives give up once a peer has failed.

    ``torch.distributed`` calls (``all_reduce``, ``barrier``,
    ``get_world_size`` ...) accept it wherever they accept the group itself.
    """

    def __init__(self, inner: dist.ProcessGroup, failure: RankFailure) -> None:
        super().__init__(inner.rank(), inner.size())
        self._inner: Optional[dist.ProcessGroup] = inner
        self._failure = failure
        self.pending: Optional[dist.Work] = None

    def _check(self) -> None:
        f = self._failure
        if f.failed and f.cp_rank != self.rank():
            raise PeerRankFailed(
                f"cp_rank {self.rank()} stopped waiting: cp_rank {f.cp_rank} failed with {f.error!r}"
            )

    def _collective(self, name: str, *args: Any, **kwargs: Any) -> dist.Work:
        self._check()
        if self._inner is None:
            raise RuntimeError(f"cp_rank {self.rank()}: the group was released")
        # Only ``pending`` refers to the operation: a Work keeps the group's
        # sockets open, and a traceback must not keep it alive.
        self.pending = getattr(self._inner, name)(*args, **kwargs)
        while not self.pending.is_completed():
            self._check()  # leaves the operation pending: release_groups ends it
            try:
                self.pending.wait(POLL)
            except RuntimeError:
                pass  # a poll time-out, or the operation's own error (raised below)
        work, self.pending = self.pending, None
        work.wait()  # the operation's own error, if any
        return work

    # Blocking collectives SGLang and the adapters may run on a cache group.
    allreduce = _blocking("allreduce")
    allreduce_coalesced = _blocking("allreduce_coalesced")
    barrier = _blocking("barrier")
    broadcast = _blocking("broadcast")
    allgather = _blocking("allgather")
    _allgather_base = _blocking("_allgather_base")

    def release(self) -> bool:
        """Drop the gloo group (closing its sockets) unless an operation is
        still in flight; True once released."""
        if self.pending is not None and not self.pending.is_completed():
            return False
        self.pending = None
        self._inner = None
        return True

    @property
    def released(self) -> bool:
        return self._inner is None

    def strand(self) -> None:
        """Give up on a group whose operation never ends (see ``_STRANDED``)."""
        if self._inner is not None:
            _STRANDED.append(self._inner)
            self.pending = None
            self._inner = None


def release_groups(groups: Sequence[FailFastGroup], timeout_s: float = 10.0) -> list[int]:
    """Release every group, idle ones first: each release closes sockets that
    end the operations peers still wait in. Returns the ranks whose group
    could not be released within ``timeout_s`` (stranded, never destroyed)."""
    waiting = [g for g in groups if not g.released]
    deadline = time.monotonic() + timeout_s
    while waiting:
        waiting = [g for g in waiting if not g.release()]
        if waiting:
            if time.monotonic() > deadline:
                for g in waiting:
                    g.strand()
                return [g.rank() for g in waiting]
            time.sleep(POLL.total_seconds() / 4)
    return []
