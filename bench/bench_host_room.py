"""Host room on SGLang 0.5.23: host hits and lost backups of upstream's path
against the library's three host-room rules, on ten workloads.

Usage (the 0.5.23 environment):

    .venv-0523/bin/python bench/bench_host_room.py [--out FILE.json] [--only N,...]

Each workload (CP size, device / host pages per rank, seed; synthetic chat,
400 requests, 2 layers) runs four times through ``simulate``: ``--copy
upstream``, then ``--copy library`` with ``SGLANG_CP_HICACHE_HOST_TAIL``
``whole`` (whole-leaf eviction), ``shortest`` (the shortest tail always) and
``covering`` (the default). The first four workloads were the ones studied
while the rules were written; the last six were chosen before their results
were seen. The output is written after every run, and a rerun with the same
``--out`` keeps the runs it already holds (same command), so an interrupted
sweep resumes. Without ``--out`` it writes a new file under
``build/bench-results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bench_paths import out_path

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 400


@dataclass(frozen=True)
class Workload:
    cp: int
    device_pages: int
    host_pages: int
    seed: int

    @property
    def name(self) -> str:
        return f"cp{self.cp}-d{self.device_pages}-h{self.host_pages}-s{self.seed}"


WORKLOADS = (
    Workload(4, 16, 24, 0), Workload(8, 8, 12, 0), Workload(4, 12, 16, 3), Workload(2, 8, 12, 7),
    Workload(2, 8, 12, 1), Workload(3, 10, 14, 5), Workload(8, 8, 12, 2), Workload(4, 12, 16, 11),
    Workload(2, 8, 12, 3), Workload(4, 16, 24, 5),
)
#: variant -> (copy path, SGLANG_CP_HICACHE_HOST_TAIL or None)
VARIANTS = {
    "upstream": ("upstream", None),
    "whole": ("library", "whole"),
    "shortest": ("library", "shortest"),
    "covering": ("library", "covering"),
}
FIELDS = ("host_hit_tokens", "device_hit_tokens", "write_failures", "backups_attempted", "verified_pages",
          "restored_pages_verified", "indexer_pages_verified", "corrupted_pages", "ranks_agree", "ok")


def command(w: Workload, variant: str) -> list[str]:
    copy, _ = VARIANTS[variant]
    return ["simulate", "--engine", "loop", "--cp-size", str(w.cp), "--device-pages", str(w.device_pages), "--host-pages",
            str(w.host_pages), "--requests", str(REQUESTS), "--seed", str(w.seed), "--copy", copy, "--no-progress"]


def run(w: Workload, variant: str) -> dict[str, Any]:
    _, tail = VARIANTS[variant]
    env = dict(os.environ)
    env.pop("SGLANG_CP_HICACHE_HOST_TAIL", None)
    if tail is not None:
        env["SGLANG_CP_HICACHE_HOST_TAIL"] = tail
    with tempfile.TemporaryDirectory(prefix="cp-host-room-") as tmp:
        out = Path(tmp) / "run.json"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "sglang_cp_hicache", *command(w, variant), "--json", str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"{w.name} {variant} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        summary = json.loads(out.read_text())
    return {k: summary[k] for k in FIELDS} | {
        "invariant_violations": len(summary.get("invariant_violations") or []),
        "sglang_version": summary["sglang_version"],
        "wall_seconds": round(wall, 1),
        "command": " ".join(([f"SGLANG_CP_HICACHE_HOST_TAIL={tail}"] if tail else [])
                            + ["python -m sglang_cp_hicache", *command(w, variant)]),
    }


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated workload indices (0-9) to run")
    args = ap.parse_args(argv)
    out = Path(out_path(args.out, "host_room", "json"))
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    doc: dict[str, Any] = {"bench": "host_room", "requests": REQUESTS, "workload": "synthetic-chat",
                           "variants": {k: {"copy": c, "host_tail": t} for k, (c, t) in VARIANTS.items()},
                           "runs": {}}
    if out.exists():
        old = json.loads(out.read_text())
        doc["runs"] = old.get("runs", {})
    for i, w in enumerate(WORKLOADS):
        if only is not None and i not in only:
            continue
        entry = doc["runs"].setdefault(w.name, {"cp": w.cp, "device_pages": w.device_pages,
                                                "host_pages": w.host_pages, "seed": w.seed, "index": i})
        for variant in VARIANTS:
            prior = entry.get(variant)
            if prior and prior.get("command", "").endswith(" ".join(command(w, variant))):
                continue
            entry[variant] = run(w, variant)
            r = entry[variant]
            print(f"{w.name:<20} {variant:<9} host hits {r['host_hit_tokens']:>7,} write failures "
                  f"{r['write_failures']:>3} corrupted {r['corrupted_pages']} ok {r['ok']} ({r['wall_seconds']} s)",
                  flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1) + "\n")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
