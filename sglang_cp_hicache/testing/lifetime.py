"""Tie a simulator process's life to the launcher that started it.

A rank must never outlive its launcher: once the launcher is gone (SIGKILL
included, which runs no cleanup) nobody reads the rank's results or stops it,
and a rank blocked in a collective or a pipe write would wait forever. Two
independent guards, both set up first thing in the child:

* Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the process
  when its parent dies. The signal fires when the parent *thread* that forked
  it exits (not the parent process), and exists on Linux only;
* a watchdog thread that polls ``os.getppid()``: once the launcher is gone the
  process is re-parented, the pid changes, and the watchdog ends the process
  with ``os._exit`` (no atexit handlers, no thread joins, so a thread stuck
  writing to a pipe nobody reads cannot hold the process).

Both are armed by the rank's first line of Python (``rank_main``), after the
interpreter and ``multiprocessing``'s bootstrap have started (a few seconds:
importing the package imports torch). If the launcher died before that,
``os.getppid()`` already differs and the process exits as soon as it gets
there.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

__all__ = ["EXIT_LAUNCHER_GONE", "WATCHDOG_POLL_S", "die_with_launcher", "end_process", "set_parent_death_signal"]

#: Exit status of a process that ended because its launcher disappeared.
EXIT_LAUNCHER_GONE = 75
#: How often the watchdog looks at the parent pid: the delay before an orphan exits.
WATCHDOG_POLL_S = 0.2

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` when the parent thread exits.
    True when set; False off Linux or when prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher_pid: int, poll_s: float) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(poll_s)
    os._exit(EXIT_LAUNCHER_GONE)


def die_with_launcher(launcher_pid: int, *, poll_s: float = WATCHDOG_POLL_S) -> None:
    """Make this process end as soon as ``launcher_pid`` (its parent) is gone."""
    if isinstance(launcher_pid, bool) or not isinstance(launcher_pid, int) or launcher_pid < 1:
        raise ValueError(f"launcher_pid must be a positive int, got {launcher_pid!r}")
    if not poll_s > 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
    set_parent_death_signal()
    if os.getppid() != launcher_pid:  # gone before the signal was armed
        os._exit(EXIT_LAUNCHER_GONE)
    threading.Thread(target=_watch, args=(launcher_pid, poll_s), name="launcher-watchdog", daemon=True).start()


def end_process(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """End a child still running: SIGTERM, then SIGKILL after ``grace_s``; its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
