"""Simulator settings (what the CLI flags become) and the per-process spec."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "DSA_PAGE_SIZE",
    "FAILURE_MODES",
    "FAIL_ENV",
    "FailureInjection",
    "RankSpec",
    "SimConfig",
    "parse_failure_injection",
]

#: SGLang 0.5.18's DSATokenToKVPool asserts page_size == 64 outside ROCm.
DSA_PAGE_SIZE = 64
#: Hidden test hook: "RANK:STEP" raises on rank RANK before request STEP;
#: "RANK:STEP:hang" makes it stop responding instead (tests the timeouts);
#: "RANK:STEP:corrupt" flips one restored byte on RANK at its first load-back
#: from request STEP on (tests that the bit-exact check catches it).
FAIL_ENV = "SGLANG_CP_HICACHE_SIM_FAIL_RANK"


@dataclass(frozen=True)
class SimConfig:
    cp_size: int = 2
    page_size: int = DSA_PAGE_SIZE
    num_layers: int = 2
    num_requests: int = 120
    seed: int = 0
    device_pages: int = 12  # physical, per rank
    host_pages: int = 16  # per rank
    collective_timeout_s: float = 60.0
    grace_s: float = 5.0  # after one rank fails, how long the others get to exit

    @property
    def logical_device_pages(self) -> int:
        """Logical pages of the shared pool, page 0 (padding) included."""
        return self.device_pages * self.cp_size

    @property
    def max_request_tokens(self) -> int:
        """Longest request the logical device pool can hold at once."""
        return (self.logical_device_pages - 1) * self.page_size


FAILURE_MODES = ("raise", "hang", "corrupt")


@dataclass(frozen=True)
class FailureInjection:
    rank: int
    step: int
    mode: str = "raise"  # one of FAILURE_MODES


def parse_failure_injection(value: Optional[str] = None) -> Optional[FailureInjection]:
    """Read :data:`FAIL_ENV` (or ``value``); ValueError on a malformed one."""
    raw = os.environ.get(FAIL_ENV) if value is None else value
    if not raw:
        return None
    parts = raw.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in FAILURE_MODES):
            raise ValueError
        rank, step = int(parts[0]), int(parts[1])
        if rank < 0 or step < 0:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{FAIL_ENV}={raw!r}: expected RANK:STEP[:MODE], MODE one of {', '.join(FAILURE_MODES)}"
        ) from None
    return FailureInjection(rank, step, parts[2] if len(parts) == 3 else "raise")


@dataclass(frozen=True)
class RankSpec:
    """What one spawned process needs (picklable)."""

    config: SimConfig
    rank: int  # -1: the non-CP comparison process
    cp_mode: bool
    master_port: int
    requests: tuple[tuple[int, ...], ...]
    log_path: str
    progress: bool  # send Progress messages (rank 0 and the non-CP process)
    failure: Optional[FailureInjection] = None
