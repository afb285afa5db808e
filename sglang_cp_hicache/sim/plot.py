"""PNG of a simulation summary (matplotlib, Agg; the ``bench`` extra).

Three panels over the requests, each showing one thing the run proves:

1. host pages the CP ranks hold together (each rank its own pages), against
   the logical host pool (N x the pages of a rank) and the non-CP process's;
2. each rank's share of those pages against 1/N: the sharding keeps every
   rank near 1/N whether or not the pool is full (a share is never hidden
   under the pool's cap, as per-rank page counts at the cap are);
3. cumulative hits per tier (device, host, L3, stacked), the ideal (an
   infinite cache) and the non-CP baseline's hits; the title carries the
   totals.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

__all__ = ["PlotUnavailable", "check_matplotlib", "plot_summary"]


class PlotUnavailable(RuntimeError):
    pass


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: "
            "pip install 'sglang-cp-hicache[bench]' (or pip install matplotlib)"
        ) from None


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _host_panels(top: Any, share: Any, summary: dict[str, Any], steps: list[int], cmap: Any) -> None:
    N, P = summary["cp_size"], summary["page_size"]
    per_rank = summary["series"]["host_slots_per_rank"]
    together = [sum(col) / P for col in zip(*per_rank)]
    top.plot(steps, together, color="navy", lw=1.4, label=f"CP: pages held by the {N} ranks together")
    top.axhline(N * summary["host_pages"], color="gray", ls=":", lw=1,
                label=f"logical host pool: {N} x {summary['host_pages']} pages")
    if "non_cp_host_slots" in summary["series"]:
        top.plot(steps, [s / P for s in summary["series"]["non_cp_host_slots"]], color="crimson", ls="--",
                 lw=1.1, label=f"non-CP, one pool of {summary['non_cp']['host_pages']} pages")
    top.set_ylabel("host pages in use")
    top.legend(fontsize=7, loc="lower right", framealpha=0.9)
    top.grid(alpha=0.3)
    for rank, slots in enumerate(per_rank):
        shares = [s / (t * P) if t else None for s, t in zip(slots, together)]
        share.plot(steps, shares, lw=0.9, color=cmap(rank / max(N - 1, 1) * 0.9), label=f"rank {rank}")
    share.axhline(1 / N, color="black", ls="--", lw=1, label=f"1/{N}")
    share.set_ylabel("rank's share of\nthe CP host pages")
    share.set_ylim(max(0.0, 1 / N - 0.15), min(1.0, 1 / N + 0.15))
    share.legend(fontsize=7, ncol=min(N + 1, 9), loc="upper right", framealpha=0.9)
    share.grid(alpha=0.3)


def _hit_panel(ax: Any, summary: dict[str, Any], steps: list[int]) -> None:
    series = summary["series"]
    l3 = series.get("l3_hit_tokens") or [0] * len(steps)
    host_only = [max(h - x, 0) for h, x in zip(series["host_hit_tokens"], l3)]
    tiers = [
        ("device", list(accumulate(series["device_hit_tokens"])), "tab:blue"),
        ("host", list(accumulate(host_only)), "tab:orange"),
        ("L3", list(accumulate(l3)), "tab:green"),
    ]
    ax.stackplot(steps, *[t[1] for t in tiers], labels=[f"{t[0]} hits" for t in tiers],
                 colors=[t[2] for t in tiers], alpha=0.75)
    if series.get("ideal_hit_tokens"):
        ax.plot(steps, list(accumulate(series["ideal_hit_tokens"])), color="black", lw=1.4,
                label="ideal (infinite cache)")
    if "non_cp_hit_tokens" in series:
        ax.plot(steps, list(accumulate(series["non_cp_hit_tokens"])), color="crimson", ls="--", lw=1.1,
                label="non-CP hits")
    ax.set_xlabel("request")
    ax.set_ylabel("cumulative hit tokens")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    verdict = "bit-exact" if summary["corrupted_pages"] == 0 else f"{summary['corrupted_pages']} CORRUPTED"
    title = (f"hit_ratio {_fmt(summary.get('hit_ratio'))} of the ideal "
             f"({summary.get('hit_tokens', 0):,} of {summary.get('ideal_hit_tokens', 0):,} tokens)")
    if "capacity_efficiency" in summary:
        title += f", capacity_efficiency {_fmt(summary['capacity_efficiency'])}"
    title += (f"\n{summary['verified_pages']:,} owned pages verified "
              f"({summary['restored_pages_verified']:,} just restored), {verdict}")
    ax.set_title(title, fontsize=9)


def plot_summary(summary: dict[str, Any], path: str) -> None:
    """Write the three panels to ``path`` (a PNG whatever the name ends with)."""
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    N = summary["cp_size"]
    fig, (top, share, bottom) = plt.subplots(3, 1, figsize=(9, 9.5), sharex=True,
                                             gridspec_kw={"height_ratios": [3, 2, 3]})
    steps = list(range(1, len(summary["series"]["device_hit_tokens"]) + 1))
    _host_panels(top, share, summary, steps, plt.get_cmap("viridis"))
    top.set_title(
        f"CP{N} HiCache simulation, SGLang {summary['sglang_version']} ({summary['copy_path']} copies): "
        f"{summary['requests']} requests of {summary['workload']}\n"
        f"per rank {summary['device_pages']} device / {summary['host_pages']} host pages",
        fontsize=10,
    )
    _hit_panel(bottom, summary, steps)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # whatever the name ends with: --plot promises a PNG
    plt.close(fig)
