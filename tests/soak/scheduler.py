"""One scheduler-driven random soak run: a random synthetic chat workload
through SGLang's real Scheduler (``simulate --engine scheduler``'s engine)
with random CP size, loop, chunk size, running-request cap, arrival window
(bursts: up to 32 requests land at once), aborts, device pressure and, on
0.5.18 decode runs, forced retraction (SGLang's own switch); 0.5.18 runs
with the insert trap on (a host read of a device index inside an insert
fails the run).

    python -m tests.soak.scheduler --seed 123 [--report steps.jsonl]

Every batch is checked on every rank by the forward stand-in (each prefix
row attention would read holds its content on its owner), SGLang's strict
idle leak checks run whenever the ranks go idle and at shutdown, and the
summary must pass (every request finished or aborted on purpose, hits within
the ideal). Prints one JSON line (and appends it to --report): seed, the
draw, requests, steps (batches), passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import sys
import time
import traceback
from dataclasses import replace
from typing import Any

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.engine_scheduler import EngineOptions, replay_through_scheduler
from sglang_cp_hicache.sim.ideal import ideal_cache
from sglang_cp_hicache.sim.rates import WorkloadFacts
from sglang_cp_hicache.sim.report_scheduler import summarize_scheduler
from sglang_cp_hicache.sim.workload import pack_requests, synthetic_chat


def draw(seed: int, version: str) -> tuple[SimConfig, EngineOptions, int]:
    """The run's config, engine options and request count, from ``seed``."""
    rng = random.Random(seed)
    cp = rng.choice((2, 3))
    device_pages = rng.randint(8, 14)  # per rank: pressure, the device fills with evictable pages
    config = SimConfig(cp_size=cp, device_pages=device_pages, host_pages=device_pages * rng.choice((2, 3)),
                       seed=seed, sglang_version=version, copy_path="library")
    running = rng.randint(2, 8)
    requests = rng.randint(40, 160)  # enough batches per start-up (the ranks take most of a minute to build)
    decode = version == "0.5.18" and rng.random() < 0.5  # 0.5.23 at CP > 1 is a PD prefill server
    opts = EngineOptions(
        max_running_requests=running, chunked_prefill_size=64 * rng.choice((1, 2, 4, 8)),
        in_flight=rng.choice((1, 2, running, 3 * running, 32)), max_new_tokens=rng.randint(2, 40) if decode else 1,
        overlap=rng.random() < 0.5,
        aborts=frozenset(i for i in range(requests) if rng.random() < 0.1), batch_timeout_s=300.0)
    # drawn last, so the draws above stay what each seed drew before
    opts = replace(opts, forced_retract_interval=rng.choice((0, 3, 7)) if decode else 0,
                   trap_insert_reads=version == "0.5.18")
    return config, opts, requests


def run(seed: int, version: str) -> dict[str, Any]:
    config, opts, n = draw(seed, version)
    reqs = synthetic_chat(n, seed=seed, max_tokens=max(config.max_request_tokens // 2, 400))
    packed = pack_requests(reqs)
    facts = WorkloadFacts(prompt_tokens=packed.total_tokens,
                          ideal_hit_tokens=ideal_cache(packed, config.page_size).hit_tokens)
    row: dict[str, Any] = {"seed": seed, "release": version, "cp_size": config.cp_size,
                           "device_pages": config.device_pages, "chunk": opts.chunked_prefill_size,
                           "max_running": opts.max_running_requests, "in_flight": opts.window,
                           "max_new_tokens": opts.max_new_tokens, "overlap": opts.overlap,
                           "forced_retract_interval": opts.forced_retract_interval,
                           "aborts": len(opts.aborts), "requests": n, "steps": 0, "passed": False}
    start = time.monotonic()
    try:
        replay = replay_through_scheduler(config, packed, opts)
        summary = summarize_scheduler(config, opts, "synthetic-chat", replay, facts, allow_unverified=True)
        row.update(steps=summary["batches"], aborted=summary["aborted"], passed=summary["ok"],
                   problems=summary["problems"], load_backs=summary["load_backs"],
                   declined=summary["load_backs_declined"], retracted=summary["retracted"])
    except Exception as exc:  # noqa: BLE001 - reported as a failed run with its cause
        row["error"] = f"{type(exc).__name__}: {exc}"[-6000:]
        row["traceback"] = traceback.format_exc()[-3000:]
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.scheduler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--report", default=None, help="append the run's JSON line here")
    args = parser.parse_args(argv)
    row = run(args.seed, importlib.metadata.version("sglang"))
    line = json.dumps(row)
    print(line, flush=True)
    if args.report:
        with open(args.report, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0 if row["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
