"""A bounded file L3 directory in the simulator: its cap held, and the L3 hits
of evicting chains from their ends (least recently used leaves) against
evicting whole chains at random, and against no bound.

Usage: python bench/bench_l3_bound.py [--requests 200] [--cap-pages 40] [--out FILE.json]

For each policy (``unbounded``, ``lru-leaves``, ``random-chains``): a CP 4
run writes a fresh directory (the directory's bytes sampled every 20 ms),
then a CP 2 run of the same requests reads a copy of it (same cap and
policy: it writes what it recomputes). SGLang's
``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`` sets the cap; the policy is
``SGLANG_CP_HICACHE_L3_EVICTION``. Without ``--out`` it writes a new file
under ``build/bench-results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from sglang_cp_hicache.sim.l3_usage import peak_stored_bytes, stored_bytes

from bench_paths import out_path

ROOT = Path(__file__).resolve().parents[1]
HEADER = 140
SHAPES = {
    "writer": ("--cp-size", "4", "--device-pages", "16", "--host-pages", "8"),
    "reader": ("--cp-size", "2", "--device-pages", "32", "--host-pages", "16"),
}


def _run(role: str, l3: Path, out: Path, requests: int, env: dict[str, str]) -> tuple[dict[str, Any], int]:
    cmd = [sys.executable, "-m", "sglang_cp_hicache", "simulate", "--engine", "loop", "--no-progress",
           *SHAPES[role], "--requests", str(requests), "--l3", str(l3), "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = peak_stored_bytes(proc, l3)
    text = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{role} run failed:\n{text}")
    return json.loads(out.read_text()), max(peak, stored_bytes(l3))


def _fields(summary: dict[str, Any], peak: int) -> dict[str, Any]:
    return {k: summary[k] for k in ("l3_written_pages", "l3_hit_tokens", "l3_pages_verified", "l3_rejected_objects",
                                    "corrupted_pages", "ok")} | {"peak_bytes": peak}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--cap-pages", type=int, default=40, help="the cap, in the simulator's pages (KV + indexer)")
    ap.add_argument("--threads", type=int, default=2, help="L3 I/O threads per rank")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    page = HEADER + 2 * 64 * 576 + HEADER + 2 * 64 * 132
    cap = args.cap_pages * page
    result: dict[str, Any] = {
        "command": f"python bench/bench_l3_bound.py --requests {args.requests} --cap-pages {args.cap_pages} "
                   f"--threads {args.threads}",
        "cap_bytes": cap, "page_bytes": page, "threads": args.threads,
        "allowed_peak_bytes": cap + 4 * args.threads * (HEADER + 2 * 64 * 576),
    }
    root = Path(tempfile.mkdtemp(prefix="bench-l3-bound-"))
    try:
        for policy in ("unbounded", "lru-leaves", "random-chains"):
            env = {"SGLANG_CP_HICACHE_L3_THREADS": str(args.threads)}
            if policy != "unbounded":
                env |= {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": str(cap), "SGLANG_CP_HICACHE_L3_EVICTION": policy}
            directory = root / policy
            writer, peak_w = _run("writer", directory, root / f"{policy}-writer.json", args.requests, env)
            shutil.copytree(directory, root / f"{policy}-copy")
            reader, peak_r = _run("reader", root / f"{policy}-copy", root / f"{policy}-reader.json", args.requests,
                                  env)
            result[policy] = {"writer": _fields(writer, peak_w), "reader": _fields(reader, peak_r)}
            print(policy, json.dumps(result[policy]))
        lru, rnd = result["lru-leaves"], result["random-chains"]
        for role in ("writer", "reader"):
            if rnd[role]["l3_hit_tokens"]:
                result[f"{role}_hits_lru_over_random"] = round(lru[role]["l3_hit_tokens"] / rnd[role]["l3_hit_tokens"], 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = Path(out_path(args.out, "l3_bound", ".json"))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
