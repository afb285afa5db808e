"""Look at processes through /proc (Linux): who is whose child, who is still alive."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Optional


def _stat_fields(pid: int) -> Optional[list[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (exited, not yet reaped) counts as gone."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and int(fields[1]) == pid:
                out.append(int(entry))
    return sorted(out)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return sorted(out)


def spawned_ranks(pid: int) -> list[int]:
    """A launcher's rank processes: the children of the zygote it spawned
    (the launcher's child started by multiprocessing's spawn, not its
    resource tracker)."""
    zygotes = [c for c in children(pid) if "spawn_main" in cmdline(c)]
    return [rank for zygote in zygotes for rank in children(zygote)]


def fd_target(pid: int, fd: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def wait_until(condition: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return condition()


def kill_all(pids: list[int]) -> None:
    """Test cleanup: end processes the test started (by pid)."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
