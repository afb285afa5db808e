"""Tables (markdown) and the sizing plot of a bench/fleet.sh run.

    python bench/fleet_table.py OUT_DIR

Writes OUT_DIR/tables.md (routes x scopes; the sizing sweeps) and, where
matplotlib is installed and a sweep ran, OUT_DIR/sizing.png (fleet hit_ratio
against the L3 directory's max size, against host pages per rank and against
the Mooncake segment per CP rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

_UNITS = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _row(name: str, s: dict[str, Any]) -> str:
    t = s["hit_tokens_per_tier"]
    sizes = s["store_size"]
    return (f"| {name} | {s['requests'] - s['requests_lost']} | {_pct(s['hit_ratio'])} | {t['device']:,} | "
            f"{t['host']:,} | {t['l3']:,} | {s['ideal_hit_tokens']:,} | {s['l3_restored_from_other_deployment']:,} | "
            f"{s['l3_restored_from_other_release']:,} | {s['l3_written_bytes'] / 1e6:.0f} / "
            f"{s['l3_read_bytes'] / 1e6:.0f} | {sizes[-1]['bytes'] / 1e6:.0f} | {s['replay_wall_seconds']:.0f} | "
            f"{s['corrupted_pages']} |")


HEADER = ("| run | served | hit_ratio | device | host | L3 | ideal | L3 pages from other deployments | "
          "of which other release | L3 MB written / read | store MB at end | replay s | corrupted |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _segment_mib(name: str) -> float:
    """``segment-64mb`` / ``segment-1gb`` -> MiB (Mooncake's units: 2**20, 2**30 bytes)."""
    text = name.split("-", 1)[1].lower()
    return float(text[:-2]) * (1024 if text.endswith("gb") else 1)


def _size_bytes(name: str) -> float:
    text = name.split("-", 1)[1]
    return float(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else float(text)


def main(out: Path) -> None:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    lines = []
    for prefix, title in (("route-", "routes and scopes"), ("size-", "L3 max size (fleet scope, prefix-affinity)"),
                          ("host-", "host pages per rank (fleet scope, prefix-affinity)"),
                          ("segment-", "Mooncake segment per CP rank (--l3 mooncake, fleet scope, prefix-affinity; "
                                       "store MB at end: the master's allocated bytes)")):
        names = [n for n in runs if n.startswith(prefix)]
        if prefix == "size-":
            names.sort(key=_size_bytes)
        elif prefix == "host-":
            names.sort(key=lambda n: int(n.split("-")[1]))
        elif prefix == "segment-":
            names.sort(key=_segment_mib)
        if names:
            lines += [f"### {title}", "", HEADER, *(_row(n, runs[n]) for n in names), ""]
    (out / "tables.md").write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(out, runs)


def _plot(out: Path, runs: dict[str, dict[str, Any]]) -> None:
    sizes = sorted((n for n in runs if n.startswith("size-")), key=_size_bytes)
    hosts = sorted((n for n in runs if n.startswith("host-")), key=lambda n: int(n.split("-")[1]))
    segments = sorted((n for n in runs if n.startswith("segment-")), key=_segment_mib)
    if not (sizes or hosts or segments):
        return
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no sizing.png", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(sizes, [_size_bytes(n) / 1e6 for n in sizes], "L3 max size (MB)"),
              (hosts, [int(n.split("-")[1]) for n in hosts], "host pages per rank")]
    if segments:
        panels.append((segments, [_segment_mib(n) for n in segments], "Mooncake segment per CP rank (MiB)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (names, xs, label) in zip(axes, panels):
        ax.plot(xs, [runs[n]["hit_ratio"] for n in names], marker="o")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the swept points, not log decades
        ax.minorticks_off()
        ax.set_xlabel(label)
        ax.set_ylabel("fleet hit_ratio (of one infinite cache)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "sizing.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
