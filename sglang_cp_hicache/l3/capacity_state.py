"""The shared state of a bounded file L3 directory (``DIR/.l3-capacity``),
as every writer of the directory reads and rewrites it under its lock: the
bytes in use, the objects being written and who writes them, the bound the
directory was made with. The state is hostile input (anyone who can write
the directory can write it): :func:`parse_state` raises on any bad field,
and its reader then counts the directory again.

A writer that dies between reserving an object's bytes and writing it
leaves its registration behind; :func:`drop_dead_writers` drops one at once
where its writer's pid is on this host and gone, and any after
:data:`STALE_PENDING_S`.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["HOST", "STALE_PENDING_S", "State", "drop_dead_writers", "parse_state"]

#: A registration older than this belongs to a writer that died mid-write.
STALE_PENDING_S = 600.0


def _host_identity() -> Optional[str]:
    """This host, boot and pid namespace: where a pid names the same
    process (containers on one host may share its name). None: unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


HOST = _host_identity()


def _alive(pid: object) -> bool:
    """Whether process ``pid`` of this host runs (True when it cannot tell)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another account's: alive
    return True


@dataclass
class State:
    """The shared state: bytes in use; the objects being written (name ->
    [bytes, parent, registered at]) and their writers (name -> [pid, host];
    a key of its own, so earlier releases read the state as they did); the
    bound it was made with (None: not recorded); ``floor``: [free bytes
    expected once the file system shows the last frees, when counted] or
    None."""

    used: int = 0
    pending: dict[str, list] = field(default_factory=dict)
    writers: dict[str, list] = field(default_factory=dict)
    max_size: Optional[int] = None
    min_free_space: Optional[int] = None
    floor: Optional[list] = None


def parse_state(raw: Any) -> State:
    """The state as read from JSON (hostile input: any bad field raises)."""
    pending = {str(k): list(v) for k, v in raw["pending"].items()}
    for entry in pending.values():
        int(entry[0]), str(entry[1]), float(entry[2])
    writers = {str(k): list(v) for k, v in (raw.get("writers") or {}).items() if k in pending}
    floor = raw.get("floor")
    if floor is not None:
        floor = [int(floor[0]), float(floor[1])]
    bound = raw.get("max_size"), raw.get("min_free_space")
    max_size, min_free = (None, None) if None in bound else (int(bound[0]), int(bound[1]))
    return State(int(raw["used"]), pending, writers, max_size, min_free, floor)


def drop_dead_writers(state: State) -> bool:
    """Drop registrations of writers that died: gone from this host, or
    older than :data:`STALE_PENDING_S`; returns whether any was dropped."""
    now, dropped = time.time(), False
    for name, entry in list(state.pending.items()):
        writer = state.writers.get(name)
        here = HOST is not None and writer is not None and len(writer) == 2 and writer[1] == HOST
        # abs: a time in the future (a skewed clock, or a forged one) does not pin a registration
        if abs(now - float(entry[2])) > STALE_PENDING_S or (here and not _alive(writer[0])):
            del state.pending[name]
            state.writers.pop(name, None)
            dropped = True
    return dropped
