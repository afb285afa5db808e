"""docs/results.md's section on fleets (several deployments behind a router
on one L3), from bench/results/fleet/*/*.json (bench/fleet.sh): routes and
L3 scopes, and the sizing sweeps (L3 max size, host pages per rank); and
the headline row. Standard library only."""

from __future__ import annotations

from typing import Any, Optional

from results_sections import Results, files_line, n, table

PREFIX = "fleet/"
_UNITS = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def _runs(res: Results) -> dict[str, dict[str, Any]]:
    return {f: res.json[f] for f in sorted(res.json) if f.startswith(PREFIX) and isinstance(res.json[f], dict)
            and "deployments" in res.json[f]}


def _stem(name: str) -> str:
    return name.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _pct(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def _mb(value: Optional[int]) -> str:
    return "–" if value is None else f"{value / 1e6:,.0f}"


def _row(name: str, d: dict[str, Any]) -> list[str]:
    tiers = d.get("hit_tokens_per_tier") or {}
    sizes = d.get("store_size") or [{}]
    alone = sum(x.get("ideal_hit_tokens_alone") or 0 for x in d["deployments"])
    return [
        f"[{_stem(name)}](../bench/results/{name})", n(d.get("requests")), n(tiers.get("device")),
        n(tiers.get("host")), n(tiers.get("l3")), n(d.get("ideal_hit_tokens")), n(alone), _pct(d.get("hit_ratio")),
        n(d.get("l3_restored_from_other_deployment")), n(d.get("l3_restored_from_other_release")),
        f"{_mb(d.get('l3_written_bytes'))} / {_mb(d.get('l3_read_bytes'))}", _mb(sizes[-1].get("bytes")),
        n(d.get("corrupted_pages")), f"{d.get('replay_wall_seconds') or 0:.0f}", n(d.get("ok")),
    ]


HEADER = ["run", "requests", "device hits", "host hits", "L3 hits", "ideal (one infinite cache)",
          "ideals of the islands", "hit_ratio", "L3 pages from other deployments", "of which other release",
          "L3 MB written / read", "store MB at end", "corrupted", "replay s", "ok"]


def _size(stem: str) -> float:
    text = stem.split("-", 1)[1]
    return float(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else float(text)


def _segment_mib(stem: str) -> float:
    """``segment-64mb`` / ``segment-1gb`` -> MiB (Mooncake's units)."""
    text = stem.split("-", 1)[1].lower()
    return float(text[:-2]) * (1024 if text.endswith("gb") else 1)


def _deployments(d: dict[str, Any]) -> str:
    return ", ".join(f"{x['release']} CP {x['cp_size']}" for x in d["deployments"])


def section_fleet(res: Results) -> list[str]:
    runs = _runs(res)
    if not runs:
        return []
    for name in runs:
        res.take(name)
    first = next((d for f, d in runs.items() if not _stem(f).startswith("segment-")), next(iter(runs.values())))
    deps = _deployments(first)
    segments = [f for f in runs if _stem(f).startswith("segment-")]
    whole = [f for f in runs if _stem(f).startswith("whole-")]
    groups = [
        ("Routes and L3 scopes", [f for f in runs if _stem(f).startswith("route-")], None),
        ("The whole trace (every request; "
         + (f"{_deployments(runs[whole[0]])}, {n(runs[whole[0]].get('requests'))} requests, " if whole else "")
         + "pools sized with `--capacity 0.1` so three deployments fit this machine's memory; each route and "
         "L3 scope)", whole, None),
        ("Sizing: the bounded L3 directory's max size (SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, fleet scope, "
         "prefix-affinity)", [f for f in runs if _stem(f).startswith("size-")], _size),
        ("Sizing: host pages per rank (fleet scope, prefix-affinity)",
         [f for f in runs if _stem(f).startswith("host-")], lambda s: float(s.split("-")[1])),
        ("Sizing: the Mooncake segment per CP rank (`--l3 mooncake`: one master, every rank's client lending its "
         "segment; fleet scope, prefix-affinity; "
         + (_deployments(runs[segments[0]]) if segments else "") + ", the releases with the mooncake wheel; "
         "store MB at end: the master's allocated bytes)", segments, _segment_mib),
    ]
    lines = [
        "## A fleet on one L3",
        "",
        f"`bench/fleet.sh`: the first {n(first.get('requests'))} requests of the Mooncake conversation trace "
        f"(64 tokens a hash id) through `fleet` with {deps}, each deployment on the simulator's loop engine, "
        "its pools sized from the trace with `--capacity 0.25` unless the run says otherwise. The ideal is one "
        "infinite cache serving every request in trace order; the islands' ideals, an infinite cache per "
        "deployment seeing only its own requests. L3 pages from other deployments are pages a deployment "
        "restored and never stored itself (a lower bound). Replay seconds are wall time on the shared "
        "two-core machine, start-up left out, not a performance figure.",
        "",
    ]
    extras = [f for f in res.files if f.startswith(PREFIX) and f.rsplit(".", 1)[-1] in ("md", "png")]
    for title, names, key in groups:
        if not names:
            continue
        if key is not None:
            names.sort(key=lambda f: key(_stem(f)))
        lines += [f"### {title}", "", *table(HEADER, [_row(f, runs[f]) for f in names]), ""]
    for png in (f for f in extras if f.endswith("sizing.png")):
        lines += [f"![fleet hit_ratio against the L3 size, the host pages and the Mooncake segment](../bench/results/{png})", ""]
    res.used.update(extras)
    lines += [files_line(res, [*runs, *extras]), ""]
    return lines


def headline_row(res: Results) -> Optional[list[str]]:
    """Each route's fleet hit_ratio, one store against a store per deployment."""
    by = {_stem(f): d for f, d in _runs(res).items()}
    routes = ("round-robin", "least-loaded", "prefix-affinity")
    # the whole trace once every route ran in both scopes there (its prefix-affinity runs are whole-<scope>)
    whole = [(r, by.get(f"whole-{r}-fleet".replace("prefix-affinity-", "")),
              by.get(f"whole-{r}-deployment".replace("prefix-affinity-", ""))) for r in routes]
    pairs = whole if all(f is not None and a is not None for _, f, a in whole) else [
        (r, by.get(f"route-{r}-fleet"), by.get(f"route-{r}-deployment")) for r in routes]
    pairs = [(r, f, a) for r, f, a in pairs if f is not None and a is not None]
    if not pairs:
        return None
    first = pairs[0][1]
    deps = " + ".join(f"{d['release']} CP {d['cp_size']}" for d in first["deployments"])
    return [f"a fleet on one L3 ({deps}, {n(first.get('requests'))} trace requests): hit_ratio of one infinite "
            "cache, one store vs a store per deployment",
            "; ".join(f"{r} {_pct(f.get('hit_ratio'))} vs {_pct(a.get('hit_ratio'))}" for r, f, a in pairs)
            + f"; {sum(f.get('corrupted_pages') or 0 for _, f, _ in pairs)} corrupted"]
