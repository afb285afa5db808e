"""Simulator settings (what the CLI flags become) and the per-process spec."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from sglang_cp_hicache import settings
from sglang_cp_hicache.placement import DSA_PAGE_SIZE  # SGLang's DSA pools take only 64 (outside ROCm)
from sglang_cp_hicache.sim.packed import PackedRequests

__all__ = [
    "DSA_PAGE_SIZE",
    "FAILURE_MODES",
    "FAIL_ENV",
    "MAX_TIMEOUT_S",
    "COPY_PATHS",
    "NON_CP_GROUPS",
    "SGLANG_VERSIONS",
    "FailureInjection",
    "RankSpec",
    "STARTUP_FAILURE_MODES",
    "SimConfig",
    "check_seconds",
    "default_startup_timeout_s",
    "parse_failure_injection",
    "seconds_problem",
]

#: How the non-CP baseline runs (see SimConfig.non_cp_group).
NON_CP_GROUPS = ("tp", "single")
#: SGLang releases the simulator drives, and the copy paths of 0.5.23's
#: sharded pool ("library": this library's kernels; "upstream": SGLang's own).
SGLANG_VERSIONS = ("0.5.18", "0.5.23")
COPY_PATHS = settings.COPY.choices
#: Hidden test hook: "RANK:STEP[:MODE]". STEP is a request index, or "startup"
#: (before the rank imports SGLang or joins the group). MODE: "raise" (default)
#: raises on RANK; "hang" makes it stop responding (tests the timeouts);
#: "kill" / "stop" make it send itself SIGKILL / SIGSTOP (tests who gets the
#: blame); "corrupt" flips one restored byte on RANK at its first load-back from
#: request STEP on (tests that the bit-exact check catches it).
FAIL_ENV = "SGLANG_CP_HICACHE_SIM_FAIL_RANK"

#: Upper bound of every timeout: torch turns a timeout into a ``timedelta``
#: (and gloo into milliseconds), which overflows long before ``inf``; no
#: simulated start-up or collective legitimately takes a day.
MAX_TIMEOUT_S = 86_400.0


def seconds_problem(value: float) -> Optional[str]:
    """Why ``value`` is not a usable timeout in seconds (None if it is)."""
    if math.isnan(value):
        return "must be a number of seconds, got nan"
    if not value > 0:
        return f"must be > 0, got {value:g}"
    if not value <= MAX_TIMEOUT_S:  # inf included
        return f"must be at most {MAX_TIMEOUT_S:g} s (one day), got {value:g}"
    return None


def check_seconds(name: str, value: Any) -> float:
    """A finite number of seconds in (0, MAX_TIMEOUT_S]; ValueError/TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    problem = seconds_problem(float(value))
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return float(value)


def default_startup_timeout_s(cp_size: int) -> float:
    """How long the ranks get to import SGLang, meet and build their stacks.

    Every rank imports SGLang (seconds of CPU each) at the same time, so on a
    small machine start-up grows with the number of ranks: CP 8 took about
    100 s on a busy 2-core machine. 120 s plus 30 s per rank keeps the old
    180 s at CP 2 and allows 360 s at CP 8.
    """
    return 120.0 + 30.0 * cp_size


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
    startup_timeout_s: Optional[float] = None  # None: default_startup_timeout_s(cp_size)
    # The non-CP baseline: "tp" = cp_size processes on one gloo group, each with
    # the whole pool (a TP deployment of an MLA model replicates the KV cache
    # and all-reduces HiCache acks over its group); "single" = one process.
    non_cp_group: str = "tp"
    sglang_version: str = "0.5.18"  # which SGLang's stack the ranks build
    copy_path: str = "library"  # 0.5.23 only: whose copies the sharded pool runs
    # CP ranks only: the L3 directory (SGLANG_CP_HICACHE_L3_DIR in each rank
    # process; 0.5.23: the library copy path); None: no L3. The non-CP
    # baseline never uses it.
    l3_dir: Optional[str] = None
    # CP ranks only: the L3 on a Mooncake store instead (the master's
    # host:port; each rank opens its own client lending mooncake_segment_bytes).
    l3_mooncake: Optional[str] = None
    mooncake_segment_bytes: int = 64 << 20
    # CP ranks only: build the stacks as --enable-metrics does and return each
    # rank's scrape of the library's metrics (sglang_cp_hicache:*) in its report.
    metrics: bool = False
    # A fleet deployment: the directory of the pipes its coordinator feeds
    # request indices through (sim.fleet.feed); None: serve every request.
    fleet_feed: Optional[str] = None

    def __post_init__(self) -> None:
        if self.sglang_version not in SGLANG_VERSIONS:
            raise ValueError(f"sglang_version must be one of {SGLANG_VERSIONS}, got {self.sglang_version!r}")
        if self.copy_path not in COPY_PATHS:
            raise ValueError(f"copy_path must be one of {COPY_PATHS}, got {self.copy_path!r}")
        if self.sglang_version == "0.5.18" and self.copy_path != "library":
            raise ValueError("copy_path 'upstream' needs SGLang 0.5.23: 0.5.18 has no CP-sharded pool "
                             "(its CP copies are this library's)")
        if self.sglang_version == "0.5.23" and self.cp_size < 2:
            raise ValueError("SGLang 0.5.23's sharded pool needs cp_size >= 2")
        if self.l3_dir is not None and self.sglang_version == "0.5.23" and self.copy_path != "library":
            raise ValueError("l3_dir needs copy_path 'library' on SGLang 0.5.23: upstream's sharded stack "
                             "refuses storage under KV sharding")
        if self.l3_dir is not None and self.l3_mooncake is not None:
            raise ValueError("l3_dir and l3_mooncake are two L3s: give one")
        if self.l3_mooncake is not None and self.sglang_version == "0.5.23" and self.copy_path != "library":
            raise ValueError("l3_mooncake needs copy_path 'library' on SGLang 0.5.23: upstream's sharded stack "
                             "refuses storage under KV sharding")
        if self.non_cp_group not in NON_CP_GROUPS:
            raise ValueError(f"non_cp_group must be one of {NON_CP_GROUPS}, got {self.non_cp_group!r}")
        check_seconds("collective_timeout_s", self.collective_timeout_s)
        check_seconds("grace_s", self.grace_s)
        if self.startup_timeout_s is not None:
            check_seconds("startup_timeout_s", self.startup_timeout_s)

    @property
    def l3_label(self) -> Optional[str]:
        """The CP ranks' L3 as --l3 names it (None: none)."""
        return self.l3_dir if self.l3_mooncake is None else f"mooncake://{self.l3_mooncake}"

    @property
    def startup_limit_s(self) -> float:
        """The start-up timeout in force (explicit, or scaled with cp_size)."""
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return default_startup_timeout_s(self.cp_size)

    @property
    def non_cp_ranks(self) -> int:
        """Processes of the non-CP baseline."""
        return self.cp_size if self.non_cp_group == "tp" else 1

    @property
    def logical_device_pages(self) -> int:
        """Logical pages of the shared pool, page 0 (padding) included."""
        return self.device_pages * self.cp_size

    @property
    def non_cp_device_pages(self) -> int:
        """Allocatable device pages of each non-CP process: the CP run's
        logical pool (0.5.18's CP pool spends its logical page 0 on padding;
        0.5.23's sharded one has N x D allocatable pages)."""
        if self.sglang_version == "0.5.23":
            return self.logical_device_pages
        return self.logical_device_pages - 1

    @property
    def max_request_tokens(self) -> int:
        """Longest request the logical device pool can hold at once."""
        return (self.logical_device_pages - 1) * self.page_size


FAILURE_MODES = ("raise", "hang", "corrupt", "kill", "stop")
#: Modes that make sense before the replay starts ("corrupt" needs a load-back).
STARTUP_FAILURE_MODES = ("raise", "hang", "kill", "stop")


@dataclass(frozen=True)
class FailureInjection:
    rank: int
    step: Optional[int]  # request index; None: at start-up, before SGLang is imported
    mode: str = "raise"  # one of FAILURE_MODES


def parse_failure_injection(value: Optional[str] = None) -> Optional[FailureInjection]:
    """Read :data:`FAIL_ENV` (or ``value``); ValueError on a malformed one."""
    raw = os.environ.get(FAIL_ENV) if value is None else value
    if not raw:
        return None
    parts = raw.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        mode = parts[2] if len(parts) == 3 else "raise"
        rank = int(parts[0])
        step = None if parts[1] == "startup" else int(parts[1])
        if rank < 0 or (step is not None and step < 0):
            raise ValueError
        if mode not in (FAILURE_MODES if step is not None else STARTUP_FAILURE_MODES):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{FAIL_ENV}={raw!r}: expected RANK:STEP[:MODE] with STEP a request index or 'startup', "
            f"MODE one of {', '.join(FAILURE_MODES)} ('corrupt' not at startup)"
        ) from None
    return FailureInjection(rank, step, mode)


@dataclass(frozen=True)
class RankSpec:
    """What one spawned process needs (picklable while the launcher spawns it)."""

    config: SimConfig
    rank: int  # -1: the non-CP comparison process
    cp_mode: bool
    master_port: int
    requests: PackedRequests  # every request's token ids (4 bytes a token when pickled)
    log: Any  # ranklog.InheritedFd: where the process writes its stdout and stderr
    launcher_pid: int  # the process exits as soon as this one is gone
    progress: bool  # send Progress messages (rank 0 and the non-CP process)
    failure: Optional[FailureInjection] = None
