"""``fleet --plot``: one panel per deployment, over the trace, of its
cumulative hits per tier (device, host, L3) against the ideal of its
requests (one infinite cache over the whole trace), drawn as ``simulate``
draws its hit panel."""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.sim.plot import _hit_panel, check_matplotlib

__all__ = ["plot_fleet"]


def plot_fleet(summary: dict[str, Any], path: str) -> None:
    """Write the panels to ``path`` (a PNG whatever the name ends with)."""
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deps = summary["deployments"]
    fig, axes = plt.subplots(len(deps), 1, figsize=(9, 3.6 * len(deps)), sharex=True, squeeze=False)
    for ax, dep in zip(axes[:, 0], deps):
        steps = [i + 1 for i in dep["series"]["request_index"]]  # positions in the trace
        _hit_panel(ax, dep, steps)
        ax.set_xlabel("request (position in the trace)")
        ax.set_title(f"{dep['name']}: {dep['requests_served']} requests served, "
                     f"{dep['l3_restored_from_other_deployment']:,} L3 pages another deployment wrote\n"
                     + ax.get_title(), fontsize=9)
    fig.suptitle(f"fleet of {len(deps)} on {summary['workload']}, route {summary['route']}, L3 scope "
                 f"{summary['l3_scope'] or 'none'}: hit_ratio {summary['hit_ratio'] or 0:.3f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
