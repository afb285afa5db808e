"""What a CP rank tells the group once per scheduler step, inside SGLang's own
ready-ack all-reduce (no collective of its own).

Every decision the CP cache takes is computed identically on every rank from
state every rank holds (the host ledger, the CPU page mirror, the allocator
mirror), so ranks need no vote to agree. The one thing a rank cannot know
about the others is a LOCAL failure: a host allocation that failed where the
ledger said it fits, a copy that raised, a device allocation that failed
where the allocator's mirror said it fits. Each rank remembers its first
such failure since the last step (kind + the sequence number of the write or
load-back, counted identically on every rank) and appends two words per
direction to SGLang's MIN all-reduce of ready acks. After the reduce every
rank sees the same worst failure and takes the same writes / load-backs back
before any of their acks is consumed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["LocalFailure", "NO_FAILURE_SEQ", "StepStatus", "Vote"]

#: Sequence number standing for "no failure" in a MIN reduce (fits int64).
NO_FAILURE_SEQ = 2**62


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
    """The group's worst failure in one direction since the last step."""

    vote: Vote
    seq: int

    @property
    def ok(self) -> bool:
        return self.vote == Vote.OK


class StepStatus:
    """This rank's first local write and load-back failures since the last step."""

    WORDS = 4  # write vote, write seq, load vote, load seq

    def __init__(self) -> None:
        self.write: Optional[LocalFailure] = None
        self.load: Optional[LocalFailure] = None

    def fail_write(self, vote: Vote, seq: int, error: Optional[BaseException] = None) -> None:
        if self.write is None or seq < self.write.seq:
            self.write = LocalFailure(vote, seq, error)

    def fail_load(self, vote: Vote, seq: int, error: Optional[BaseException] = None) -> None:
        if self.load is None or seq < self.load.seq:
            self.load = LocalFailure(vote, seq, error)

    def words(self) -> list[int]:
        """What this rank appends to the step's MIN all-reduce."""
        out = []
        for failure in (self.write, self.load):
            out += [Vote.OK, NO_FAILURE_SEQ] if failure is None else [int(failure.vote), failure.seq]
        return out

    def read(self, reduced: list[int]) -> tuple[GroupOutcome, GroupOutcome]:
        """The group's outcome from the reduced words; clears this rank's record."""
        write = GroupOutcome(Vote(reduced[0]), reduced[1])
        load = GroupOutcome(Vote(reduced[2]), reduced[3])
        return write, load

    def clear(self) -> tuple[Optional[LocalFailure], Optional[LocalFailure]]:
        mine = (self.write, self.load)
        self.write = self.load = None
        return mine
