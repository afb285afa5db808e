"""Run ``python -m sglang_cp_hicache simulate`` as a subprocess (shared by the simulator tests)."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from typing import Optional, Sequence

from sglang_cp_hicache.sim.config import FAIL_ENV

#: The repository root: the subprocess must run there (``tests/`` holds a
#: package named ``sglang`` that would shadow SGLang itself).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A failed run must end by itself: rank startup (import sglang, a few seconds
#: per process, more on a loaded machine) + collective timeout + 3-5 s grace.
BOUND_S = 90

_LOG_DIR = re.compile(r"logs of every process: (\S+)")


def with_engine(args: Sequence[str]) -> list[str]:
    """``args``, with ``--engine loop`` added where they name no engine: the tests written for the loop
    engine (the default before the scheduler engine's) keep testing it."""
    named = any(a == "--engine" or a.startswith("--engine=") for a in args)
    return list(args) if named else ["--engine", "loop", *args]


def sim_command(*args: str, progress: bool = False) -> list[str]:
    return [sys.executable, "-m", "sglang_cp_hicache", "simulate", *([] if progress else ["--no-progress"]),
            *with_engine(args)]


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


def run_cli(argv: Sequence[str], *, env: Optional[dict] = None,
            timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    """``python -m sglang_cp_hicache ARGV`` run inside this test process, as
    a subprocess would see it: the working directory ROOT, the environment
    of :func:`sim_env`, stdout and stderr captured, the exit status from
    ``main`` (a traceback and 1 for an escaping exception).

    In process, every run of one worker forks its ranks from the worker's
    shared zygote (one per environment): the SGLang import and the hook
    check (7-9 CPU-seconds) are paid once per worker instead of once per
    run, plus the CLI's own interpreter start (2-3 s). Tests of the process
    boundary itself (signals to the launcher, the console script, another
    release's interpreter) start a real subprocess instead. A run that
    outlives ``timeout`` dumps every thread's stack and ends the worker: a
    hang guard, as ``subprocess.run``'s timeout was."""
    from sglang_cp_hicache.__main__ import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(sim_env(env))
    os.chdir(ROOT)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except Exception:  # what the interpreter would print before exiting 1
                traceback.print_exc()
                code = 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["sglang_cp_hicache", *argv], code, out.getvalue(), err.getvalue())


def simulate(*args: str, env: Optional[dict] = None, timeout: float = HANG_GUARD_S,
             progress: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """One ``simulate`` run in this process (:func:`run_cli`), and its seconds."""
    start = time.perf_counter()
    proc = run_cli(sim_command(*args, progress=progress)[3:], env=env, timeout=timeout)
    seconds = time.perf_counter() - start
    remove_kept_logs(proc.stderr)
    return proc, seconds
