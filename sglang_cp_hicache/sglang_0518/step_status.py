"""What a CP rank tells the group once per scheduler step, inside SGLang's own
ready-ack all-reduce (no collective of its own, and no wider one).

Every decision the CP cache takes is computed identically on every rank from
state every rank holds (the host ledger, the CPU page mirror, the allocator
mirror), so ranks need no vote to agree. The one thing a rank cannot know
about the others is a LOCAL failure: a host allocation that failed where the
ledger said it fits, a copy that raised, a device allocation that failed
where the allocator's mirror said it fits. Each rank remembers its
failures since the last step (per direction: where the first one is, how bad
the worst one is) and folds them into the two ready-ack counts
SGLang already MIN-reduces (write acks, load acks). After the reduce every
rank sees the same failure and takes the same writes / load-backs back
before any of their acks is consumed.

Why packed: gloo's all-reduce of 1-2 int64 costs ~0.2 ms of CPU, of 6 words
~2 ms (its ring splits the vector per rank), so widening SGLang's vector by
status words would cost every step more than the cache itself.

The two words, each compared as one int64 by MIN (high fields win)::

    word 0: write cut (40 bits) | write vote (2) | write-ack count (21)
    word 1: no write FAILED (1) | load vote (2)  | load-ack count (21)

* write cut: position of the failed write among the in-flight writes
  (identical on every rank), ``NO_CUT`` when none. MIN gives the earliest
  failure anywhere; the vote next to it is REFUSED unless word 1's top bit
  says some rank FAILED a write (then every rank raises).
* load vote: MIN over ranks unless a write FAILED somewhere; then every
  unconsumed load-back is taken back anyway, so nothing is lost.
* A rank with any failure reports 0 for both counts, so a step with a
  failure anywhere consumes no ack (the survivors' acks go next step).

A rank keeps one failure per direction: the earliest sequence number of its
failures and the worst of their votes (``FAILED`` wins over an earlier
``REFUSED``), with the error of the first ``FAILED``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["GroupOutcome", "LocalFailure", "NO_CUT", "StepExchange", "StepStatus", "Vote"]

COUNT_BITS = 21
VOTE_BITS = 2
CUT_BITS = 40
MAX_COUNT = (1 << COUNT_BITS) - 1
#: Write cut standing for "no write failed" (the largest, so MIN ignores it).
NO_CUT = (1 << CUT_BITS) - 1
_LOW = COUNT_BITS + VOTE_BITS  # where the cut / the write-failed bit start


class Vote(enum.IntEnum):
    """A rank's outcome; the group takes the MIN."""

    FAILED = 0  # an allocation or copy raised: every rank rolls back and raises
    REFUSED = 1  # a host allocation came up short: every rank rolls back quietly
    OK = 2


@dataclass(frozen=True)
class LocalFailure:
    vote: Vote
    seq: int  # write / load-back sequence number (identical on every rank)
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class GroupOutcome:
    """The group's worst failure in one direction since the last step;
    ``cut`` (writes only): take back in-flight writes from this position on."""

    vote: Vote
    cut: int = NO_CUT

    @property
    def ok(self) -> bool:
        return self.vote == Vote.OK


@dataclass(frozen=True)
class StepExchange:
    """The reduced step: ack counts every rank may consume, and the outcomes."""

    write_acks: int
    load_acks: int
    write: GroupOutcome
    load: GroupOutcome


def _merge(old: Optional[LocalFailure], new: LocalFailure) -> LocalFailure:
    """One rank's failures in one direction since the last step, as one:
    the earliest sequence number (the cut: everything from it on goes), the
    worst vote (a copy that raised must make every rank raise even after an
    earlier mere refusal) and the first error of that vote (the cause every
    rank's raise chains)."""
    if old is None:
        return new
    vote = min(old.vote, new.vote)
    errors = [f.error for f in (old, new) if f.vote == vote and f.error is not None]
    return LocalFailure(vote, min(old.seq, new.seq), errors[0] if errors else None)


class StepStatus:
    """This rank's local write and load-back failures since the last step."""

    WORDS = 2  # SGLang's two ready-ack counts, with the status folded in

    def __init__(self) -> None:
        self.write: Optional[LocalFailure] = None
        self.load: Optional[LocalFailure] = None

    def fail_write(self, vote: Vote, seq: int, error: Optional[BaseException] = None) -> None:
        self.write = _merge(self.write, LocalFailure(vote, seq, error))

    def fail_load(self, vote: Vote, seq: int, error: Optional[BaseException] = None) -> None:
        self.load = _merge(self.load, LocalFailure(vote, seq, error))

    def words(self, write_acks: int, load_acks: int, first_inflight_write_seq: Optional[int]) -> list[int]:
        """The two words this rank puts into the step's MIN all-reduce.
        ``first_inflight_write_seq``: sequence number of the oldest write
        whose ack is not consumed (identical on every rank); a failed write
        is always one of those, so its cut is its offset from it."""
        if write_acks < 0 or load_acks < 0:
            raise ValueError(f"ack counts must be >= 0, got {write_acks}, {load_acks}")
        # Consuming fewer acks than are ready is always safe: the rest go next step.
        write_acks, load_acks = min(write_acks, MAX_COUNT), min(load_acks, MAX_COUNT)
        if self.write is not None or self.load is not None:
            write_acks = load_acks = 0
        cut, write_vote = NO_CUT, Vote.OK
        if self.write is not None:
            if first_inflight_write_seq is None or not 0 <= self.write.seq - first_inflight_write_seq < NO_CUT:
                raise RuntimeError(
                    f"failed write {self.write.seq} is not in flight (oldest in flight: "
                    f"{first_inflight_write_seq})"
                )
            cut, write_vote = self.write.seq - first_inflight_write_seq, self.write.vote
        no_write_failed = 0 if write_vote == Vote.FAILED else 1
        load_vote = Vote.OK if self.load is None else self.load.vote
        return [
            (cut << _LOW) | (int(write_vote) << COUNT_BITS) | write_acks,
            (no_write_failed << _LOW) | (int(load_vote) << COUNT_BITS) | load_acks,
        ]

    @staticmethod
    def read(reduced: list[int]) -> StepExchange:
        """The group's step from the two reduced words (identical on every rank)."""
        w0, w1 = reduced[0], reduced[1]
        cut = w0 >> _LOW
        write_failed = (w1 >> _LOW) == 0
        if cut == NO_CUT:
            write = GroupOutcome(Vote.OK)
        else:
            vote = Vote.FAILED if write_failed else Vote((w0 >> COUNT_BITS) & 3)
            write = GroupOutcome(vote, cut)
        load_vote = Vote((w1 >> COUNT_BITS) & 3)
        if write_failed:  # some rank's load status may be hidden: take every load back
            load_vote = min(load_vote, Vote.REFUSED)
        return StepExchange(w0 & MAX_COUNT, w1 & MAX_COUNT, write, GroupOutcome(load_vote))

    def clear(self) -> tuple[Optional[LocalFailure], Optional[LocalFailure]]:
        mine = (self.write, self.load)
        self.write = self.load = None
        return mine
