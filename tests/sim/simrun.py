"""Run ``python -m sglang_cp_hicache simulate`` as a subprocess (shared by the simulator tests)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

from sglang_cp_hicache.sim.config import FAIL_ENV

#: The repository root: the subprocess must run there (``tests/`` holds a
#: package named ``sglang`` that would shadow SGLang itself).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A failed run must end by itself: rank startup (import sglang, a few seconds
#: per process, more on a loaded machine) + collective timeout + 3-5 s grace.
BOUND_S = 90

_LOG_DIR = re.compile(r"logs of every process: (\S+)")


def sim_command(*args: str, progress: bool = False) -> list[str]:
    return [sys.executable, "-m", "sglang_cp_hicache", "simulate", *([] if progress else ["--no-progress"]), *args]


def sim_env(env: Optional[dict] = None) -> dict:
    full_env = dict(os.environ)
    full_env.pop(FAIL_ENV, None)
    full_env.update(env or {})
    return full_env


def remove_kept_logs(stderr: str) -> list[str]:
    """A failed run keeps its rank logs for the user; the tests do not need them."""
    dirs = _LOG_DIR.findall(stderr)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    return dirs


#: A hang guard for any run, not a bound under test: a passing run on a
#: machine shared with other test workers can take minutes. Tests that bound
#: how long a failure takes assert on the returned seconds (BOUND_S).
HANG_GUARD_S = 600


def simulate(*args: str, env: Optional[dict] = None,
             timeout: float = HANG_GUARD_S) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(sim_command(*args), cwd=ROOT, env=sim_env(env), capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    remove_kept_logs(proc.stderr)
    return proc, seconds
