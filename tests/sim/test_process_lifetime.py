"""No simulator process outlives its launcher, whatever kills the launcher.

A rank arms the kernel's parent-death signal and a watchdog thread (each is
tested alone), so SIGKILL of the launcher, which runs no cleanup, still ends
every rank within a fraction of a second, and leaves no file behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from sglang_cp_hicache.sim.config import FAIL_ENV
from sglang_cp_hicache.testing.lifetime import EXIT_LAUNCHER_GONE
from tests.sim.proc_tree import alive, descendants, fd_target, kill_all, spawned_ranks, wait_until
from tests.sim.simrun import ROOT, sim_command, sim_env

#: How long an orphaned rank may take to go (watchdog poll 0.2 s; the rest is a loaded machine).
ORPHAN_EXIT_S = 5.0

_CHILD = r"""
import os, sys, threading, time
from sglang_cp_hicache.testing import lifetime
guard = sys.argv[1]
if guard == "watchdog":
    lifetime.set_parent_death_signal = lambda *args: False
elif guard == "pdeathsig":
    lifetime._watch = lambda *args: None
lifetime.die_with_launcher(os.getppid())
# a non-daemon thread stuck writing to a pipe nobody reads (what a queue feeder does)
r, w = os.pipe()
def flood():
    while True:
        os.write(w, b"x" * 65536)
threading.Thread(target=flood).start()
print("armed", flush=True)
time.sleep(600)
"""

_LAUNCHER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("guard", ["both", "watchdog", "pdeathsig"])
@pytest.mark.waits  # mostly waits out a timeout or a death, little CPU
def test_a_process_dies_with_its_launcher(guard):
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _CHILD, guard], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "armed"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert wait_until(lambda: not alive(child), ORPHAN_EXIT_S), f"pid {child} outlived its launcher ({guard})"
    finally:
        kill_all([launcher.pid, child])
        launcher.stdout.close()


@pytest.mark.waits  # mostly waits out a timeout or a death, little CPU
def test_a_launcher_already_gone_ends_the_process_at_once():
    not_my_parent = os.getppid()  # the test's parent, not the child's
    proc = subprocess.run(
        [sys.executable, "-c",
         f"from sglang_cp_hicache.testing import lifetime; lifetime.die_with_launcher({not_my_parent}); print('lived')"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == EXIT_LAUNCHER_GONE and "lived" not in proc.stdout


def _kill_launcher_and_check(launcher: subprocess.Popen, tmp_dir: str) -> None:
    tree = descendants(launcher.pid)  # the zygote, its ranks, multiprocessing's resource tracker
    assert len(tree) >= 2
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    try:
        assert wait_until(lambda: not any(alive(p) for p in tree), ORPHAN_EXIT_S), \
            f"still running after the launcher's SIGKILL: {[p for p in tree if alive(p)]}"
    finally:
        kill_all(tree)
    # the rank logs never had a name; nothing else was left either
    assert os.listdir(tmp_dir) == []


def test_sigkill_of_the_launcher_during_startup_leaves_no_rank_and_no_file(tmp_path):
    # rank 0 hangs first thing at start-up; rank 1 waits for it at the rendezvous
    launcher = subprocess.Popen(
        sim_command("--cp-size", "2", "--requests", "5"), cwd=ROOT,
        env=sim_env({FAIL_ENV: "0:startup:hang", "TMPDIR": str(tmp_path)}),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        # the ranks appear once the zygote has imported SGLang (seconds; more on a loaded machine)
        assert wait_until(lambda: len(spawned_ranks(launcher.pid)) == 2, 120)
        ranks = spawned_ranks(launcher.pid)
        # a rank redirects its stderr to its unnamed log right after arming its
        # guards: kill the launcher once both ranks are there (a rank still in
        # Python's start-up exits when it gets there and finds its parent gone)
        assert wait_until(lambda: all("(deleted)" in fd_target(p, 2) for p in ranks), 120)
        _kill_launcher_and_check(launcher, str(tmp_path))
    finally:
        kill_all([launcher.pid])


@pytest.mark.slow(10)
def test_sigkill_of_the_launcher_mid_run_leaves_no_rank_and_no_file(tmp_path):
    launcher = subprocess.Popen(
        sim_command("--cp-size", "2", "--requests", "300", progress=True), cwd=ROOT,
        env=sim_env({"TMPDIR": str(tmp_path)}), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        done = 0
        while done < 30:  # the progress bar prints a line per tenth without a terminal
            line = launcher.stderr.readline()
            assert line, "the run ended before it could be interrupted"
            match = re.search(r"(\d+)/300 requests", line)
            done = int(match.group(1)) if match else done
        _kill_launcher_and_check(launcher, str(tmp_path))
    finally:
        kill_all([launcher.pid])
        launcher.stderr.close()
