"""Which process failed first, from what the launcher saw.

When one rank dies, its peers fail too, a moment later, in their next
collective ("Connection closed by peer", a gloo timeout...). Those are
symptoms; the headline must name the cause. In order of precedence:

1. a rank's own error (an exception that is not a lost peer) or a rank that
   died without reporting anything (killed by a signal, crashed): the
   earliest one. A rank's error carries the time it happened; a silent death
   the time the launcher saw the process gone (later than the death, and
   still earlier than any symptom it caused);
2. a rank that neither reported nor exited while its peers gave up on it
   (stopped with SIGSTOP, hung): the launcher had to terminate it;
3. otherwise the earliest symptom.

Times are ``time.monotonic()``: one clock for every process on a Linux host.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Optional

from sglang_cp_hicache.sim.launcher import LaunchResult
from sglang_cp_hicache.sim.records import RankFailure

__all__ = ["FailureCause", "describe_exit", "first_cause", "is_peer_loss", "later_failures"]

#: What a rank's collective raises when a peer is gone or silent.
_PEER_LOSS_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "pair closure",
    "socket closed",
    "timed out",
)
_PEER_LOSS_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


@dataclass(frozen=True)
class FailureCause:
    rank: int
    kind: str  # "error" | "died" | "hung" | "symptom"
    step: Optional[int]  # request index (errors and symptoms only)
    detail: str  # the error, or how the process ended


def is_peer_loss(error: str) -> bool:
    """True when an error reads like a consequence of another rank failing."""
    kind = error.split(":", 1)[0].strip()
    text = error.lower()
    return kind in _PEER_LOSS_TYPES or any(marker in text for marker in _PEER_LOSS_TEXT)


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with status {code}"


def _first_line(error: str) -> str:
    return error.splitlines()[0] if error else "unknown error"


def first_cause(result: LaunchResult) -> Optional[FailureCause]:
    """The failure that started it all; None when nothing failed."""
    reported = {f.rank for f in result.failures} | {r.rank for r in result.reports}
    primary: list[tuple[float, FailureCause]] = []
    symptoms: list[tuple[float, FailureCause]] = []
    for f in result.failures:
        cause = FailureCause(f.rank, "error", f.step, _first_line(f.error))
        if is_peer_loss(f.error):
            symptoms.append((f.at, FailureCause(f.rank, "symptom", f.step, cause.detail)))
        else:
            primary.append((f.at, cause))
    hung = []
    for rank, code in sorted(result.exit_codes.items()):
        if rank in reported:
            continue
        if rank in result.killed:
            hung.append(FailureCause(rank, "hung", None, "did not answer and did not exit"))
        elif code != 0:
            seen = result.exit_seen_at.get(rank, math.inf)
            primary.append((seen, FailureCause(rank, "died", None, f"{describe_exit(code)}, without a report")))
    if primary:
        return min(primary, key=lambda item: item[0])[1]
    if hung:
        return hung[0]
    if symptoms:
        return min(symptoms, key=lambda item: item[0])[1]
    return None


def later_failures(result: LaunchResult, cause: Optional[FailureCause]) -> list[RankFailure]:
    """Every reported failure but the cause's, in the order they happened."""
    return [f for f in sorted(result.failures, key=lambda f: f.at) if cause is None or f.rank != cause.rank]
