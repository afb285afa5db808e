"""The Markdown table of bench/sim_traces.sh's results (docs/simulator.md).

    python bench/sim_traces_table.py [DIR]     # default bench/results/traces

One row per run: release and copy path, CP size, L3; hits per tier (logical
tokens), all hits, the ideal, hit_ratio, the non-CP baseline's hits and
capacity_efficiency, pages verified / corrupted, ranks agree, start-up and
replay wall seconds. A run with --l3 replays no baseline ("–"):
capacity_efficiency reads the sharded host and device pools against one
pool of the same capacity, which L3 hits would only blur. The baselines of
one release's runs (same capacity, same requests) must all agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = ("0518", "0523-library", "0523-upstream")
LABEL = {"0518": "0.5.18", "0523-library": "0.5.23 library", "0523-upstream": "0.5.23 upstream"}


def _name_key(path: Path) -> tuple:
    name = path.stem
    release = next(r for r in ORDER if name.startswith(r + "-"))
    cp = int(name.split("cp")[1].split("-")[0])
    return (ORDER.index(release), cp, name.endswith("-l3"))


def _n(value: int) -> str:
    return f"{value:,}"


def main(directory: str = "bench/results/traces") -> int:
    runs = sorted(Path(directory).glob("0*.json"), key=_name_key)
    summaries = {p.stem: json.loads(p.read_text()) for p in runs}
    baselines: dict[str, set[int]] = {}
    for name, s in summaries.items():
        if "non_cp_hit_tokens" in s:
            baselines.setdefault(name.split("-cp")[0].replace("-library", "").replace("-upstream", ""),
                                 set()).add(s["non_cp_hit_tokens"])
    for release, hits in baselines.items():
        if len(hits) != 1:
            raise SystemExit(f"{release}: the non-CP baselines disagree: {sorted(hits)}")
    print("| release, copies | CP | L3 | device hits | host hits | L3 hits | all hits | hit_ratio "
          "| non-CP hits | capacity_efficiency | pages verified (corrupted) | ranks agree | start-up s "
          "| replay s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summaries.items():
        release = next(r for r in ORDER if name.startswith(r + "-"))
        tiers = s["hit_tokens_per_tier"]
        l3 = name.endswith("-l3")
        baseline = s.get("non_cp_hit_tokens")
        versus = "– | –" if baseline is None else f"{_n(baseline)} | {s['capacity_efficiency']:.3f}"
        print(
            f"| {LABEL[release]} | {s['cp_size']} | {'yes' if l3 else 'no'} | {_n(tiers['device'])} "
            f"| {_n(tiers['host'])} | {_n(tiers['l3'])} | {_n(s['hit_tokens'])} | {s['hit_ratio']:.3f} "
            f"| {versus} "
            f"| {_n(s['verified_pages'])} ({s['corrupted_pages']}) | {'yes' if s['ranks_agree'] else 'NO'} "
            f"| {s['startup_wall_seconds']:.0f} | {s['replay_wall_seconds']:.0f} |"
        )
    first = next(iter(summaries.values()), None)
    if first is not None:
        print(f"\nIdeal (infinite cache, page-aligned): {_n(first['ideal_hit_tokens'])} of "
              f"{_n(first['prompt_tokens'])} prompt tokens ({100 * first['ideal_hit_rate']:.1f} %), "
              f"{first['requests']} requests at {first.get('trace_block_tokens')} tokens a hash id.")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
