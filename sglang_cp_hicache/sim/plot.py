"""PNG of a simulation summary (matplotlib, Agg; the ``bench`` extra)."""

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


def plot_summary(summary: dict[str, Any], path: str) -> None:
    """Host slots per rank over the run (and non-CP / N), plus cumulative
    device hits, host hits and restored tokens."""
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    N, P = summary["cp_size"], summary["page_size"]
    series = summary["series"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    steps = list(range(1, len(series["device_hit_tokens"]) + 1))
    cmap = plt.get_cmap("viridis")
    for rank, slots in enumerate(series["host_slots_per_rank"]):
        color = cmap(rank / max(N - 1, 1) * 0.9)
        top.plot(steps, [s / P for s in slots], lw=1.1, color=color, label=f"CP rank {rank}")
    title = (
        f"CP{N} HiCache simulation: {summary['requests']} requests, "
        f"device {summary['device_pages']} / host {summary['host_pages']} pages per rank"
    )
    if "non_cp_host_slots" in series:
        ref = series["non_cp_host_slots"]
        top.plot(steps, [s / P / N for s in ref], color="crimson", ls="--", lw=1.3,
                 label=f"non-CP / {N} (same logical capacity)")
        title += f"\nnon-CP peak {summary['non_cp']['host_slots'] // P} host pages in one process"
    top.axhline(summary["host_pages"], color="gray", ls=":", lw=1, label="host pool per rank")
    top.set_ylabel("host pages in use (per rank)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8, ncol=3, loc="lower right", framealpha=0.9)
    top.grid(alpha=0.3)
    for key, label, style in (
        ("device_hit_tokens", "device-hit tokens", dict(lw=1.4)),
        ("host_hit_tokens", "host-hit tokens", dict(lw=3.0, alpha=0.45)),
        ("loaded_tokens", "restored (loaded back) tokens", dict(lw=1.2, ls="--")),
    ):
        bottom.plot(steps, list(accumulate(series[key])), label=label, **style)
    bottom.set_xlabel("request")
    bottom.set_ylabel("cumulative logical tokens")
    verdict = "bit-exact" if summary["corrupted_pages"] == 0 else f"{summary['corrupted_pages']} CORRUPTED"
    bottom.set_title(
        f"{summary['verified_pages']} owned pages verified ({summary['restored_pages_verified']} just restored), "
        f"{verdict}",
        fontsize=9,
    )
    bottom.legend(fontsize=8, loc="upper left")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # whatever the name ends with: --plot promises a PNG
    plt.close(fig)
