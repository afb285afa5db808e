"""Soak the CP cache state machines: random seeds for a given time.

    python -m tests.soak --release 0.5.18 --minutes 20
    python -m tests.soak --release 0.5.23 --minutes 20 --python .venv-0523/bin/python

    python -m tests.soak --release 0.5.18 --engine scheduler --minutes 20

``--engine scheduler`` runs random workloads through SGLang's real Scheduler
instead (:mod:`tests.soak.scheduler`: arrival bursts, aborts, chunk sizes,
device pressure, both event loops), one process per seed; its steps are
batches.

``make soak`` runs all four, SOAK_MINUTES each (0.5.18 under ``.venv``, 0.5.23
under ``.venv-0523``). Each release's machine (:data:`RELEASES`) runs under
the hypothesis ``dev`` profile again and again, each run in a fresh process
with a new random seed and ``--examples`` examples, until the time is up (a
run that started goes to its end). Prints every run's seed and step count
and the totals; the first failing run stops the soak and prints the command
that repeats it. Exit status 0 only when every run passed and, with
``--min-steps`` / ``--min-seeds``, enough ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: release -> (state machine test, default hypothesis examples per run)
RELEASES = {
    "0.5.18": ("tests/sglang_0518/test_state_machine.py", 40),
    "0.5.23": ("tests/sglang_0523/test_state_machine_0523.py", 40),
}
TEST = RELEASES["0.5.18"][0]


@dataclass
class SoakRun:
    seed: int
    steps: int
    seconds: float
    passed: bool
    requests: int = 0  # scheduler runs: requests replayed


def run_once(seed: int, examples: int, python: str, test: str = TEST) -> tuple[SoakRun, str]:
    """One pytest process; its step count comes from the test's report file."""
    with tempfile.TemporaryDirectory(prefix="cp-hicache-soak-") as tmp:
        report = os.path.join(tmp, "steps.jsonl")
        env = dict(os.environ, HYPOTHESIS_PROFILE="dev", STATE_MACHINE_EXAMPLES=str(examples),
                   STATE_MACHINE_REPORT=report)
        cmd = [python, "-m", "pytest", test, "-q", "-s", "-p", "no:cacheprovider",
               f"--hypothesis-seed={seed}"]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        lines = Path(report).read_text().splitlines() if os.path.exists(report) else []
    rows = [json.loads(line) for line in lines]
    steps = sum(row["steps"] for row in rows)
    passed = proc.returncode == 0 and bool(rows) and all(row["passed"] for row in rows)
    return SoakRun(seed, steps, seconds, passed), proc.stdout + proc.stderr


def run_scheduler_once(seed: int, python: str) -> tuple[SoakRun, str]:
    """One scheduler-driven random run (:mod:`tests.soak.scheduler`) in its own process."""
    with tempfile.TemporaryDirectory(prefix="cp-hicache-soak-") as tmp:
        report = os.path.join(tmp, "run.jsonl")
        cmd = [python, "-m", "tests.soak.scheduler", "--seed", str(seed), "--report", report]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - start
        lines = Path(report).read_text().splitlines() if os.path.exists(report) else []
    row = json.loads(lines[-1]) if lines else {}
    passed = proc.returncode == 0 and bool(row.get("passed"))
    return SoakRun(seed, int(row.get("steps", 0)), seconds, passed, int(row.get("requests", 0))), \
        proc.stdout[-4000:] + proc.stderr[-4000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", choices=sorted(RELEASES), default="0.5.18",
                        help="whose state machine (the --python environment must have that SGLang)")
    parser.add_argument("--engine", choices=("state-machine", "scheduler"), default="state-machine",
                        help="the cache state machine under hypothesis, or random workloads through the real "
                             "Scheduler (tests.soak.scheduler)")
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 20)))
    parser.add_argument("--examples", type=int, default=None,
                        help="hypothesis examples per run (each up to 300 steps)")
    parser.add_argument("--min-steps", type=int, default=int(os.environ.get("SOAK_MIN_STEPS", 0)))
    parser.add_argument("--min-seeds", type=int, default=int(os.environ.get("SOAK_MIN_SEEDS", 0)))
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    test, default_examples = RELEASES[args.release]
    examples = args.examples or int(os.environ.get("SOAK_EXAMPLES", default_examples))
    if not args.minutes > 0 or examples < 1:
        parser.error("--minutes must be > 0 and --examples >= 1")

    deadline = time.monotonic() + args.minutes * 60
    rng = random.SystemRandom()
    runs: list[SoakRun] = []
    sched = args.engine == "scheduler"
    tag = f"soak {args.release}" + (" scheduler" if sched else "")
    what = "random workloads through SGLang's Scheduler" if sched else \
        f"{test}, dev profile, {examples} examples per run"
    print(f"{tag}: {what} ({args.python}), {args.minutes:g} min", flush=True)
    while time.monotonic() < deadline:
        seed = rng.randrange(2**31 if sched else 2**32)  # the simulator takes seeds below 2**31
        run, output = run_scheduler_once(seed, args.python) if sched else run_once(seed, examples, args.python, test)
        runs.append(run)
        state = "passed" if run.passed else "FAILED"
        reqs = f"{run.requests} requests, " if sched else ""
        print(f"{tag}: seed {seed}: {reqs}{run.steps} steps in {run.seconds:.0f} s, {state}", flush=True)
        if not run.passed:
            print(output[-8000:])
            repeat = (f"{args.python} -m tests.soak.scheduler --seed {seed}" if sched else
                      f"HYPOTHESIS_PROFILE=dev STATE_MACHINE_EXAMPLES={examples} "
                      f"{args.python} -m pytest {test} -s --hypothesis-seed={seed}")
            print(f"{tag}: repeat with: {repeat}")
            break
    total = sum(r.steps for r in runs)
    failed = [r.seed for r in runs if not r.passed]
    reqs = f"{sum(r.requests for r in runs)} requests, " if sched else ""
    print(f"{tag}: {reqs}{total} steps in {len(runs)} runs, seeds {[r.seed for r in runs]}; "
          f"{'failed: seed ' + str(failed) if failed else 'none failed'}")
    short = total < args.min_steps or len(runs) < args.min_seeds
    if short and not failed:
        print(f"{tag}: fewer than --min-steps {args.min_steps} steps or --min-seeds {args.min_seeds} seeds")
    return 1 if failed or short else 0


if __name__ == "__main__":
    sys.exit(main())
