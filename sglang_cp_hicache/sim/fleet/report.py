"""A fleet's summary (JSON) and its printed table.

Hits are logical tokens per tier, as each deployment's rank 0 matched them
(loop engine) or as its request's first forwarded batch started from
(scheduler engine: its cached prefix, of it what was loaded back from host,
of that the tail L3 restored for it); ``l3`` is what L3 brought to the host
for that request, ``host`` the rest of the host hit. The fleet's ideal is one infinite cache serving every
request in trace order: a request's ideal counts every page any earlier
request held, wherever it ran, so ``hit_ratio`` (hits / ideal) measures the
fleet against one perfect shared cache. A deployment's ``ideal_hit_tokens``
is that ideal over its own requests; ``ideal_hit_tokens_alone`` is an
infinite cache that saw only its own requests (an island's ceiling). The
deployments run at once, so a request can hit a page that a later request,
served at the same time elsewhere, stored first: a deployment's
``hit_ratio`` can pass 1 by that much.

Restored pages are attributed by page key: a page a deployment restored from
L3 and never stored itself, that another deployment stored, came from that
deployment (``unknown``: stored by none, e.g. left by an earlier run or by a
deployment that died before it reported). A page both stored counts as the
restorer's own, so the cross-deployment counts are lower bounds.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sglang_cp_hicache.sim.fleet.coordinator import Deployment, FleetRun
from sglang_cp_hicache.sim.ideal import ideal_cache

__all__ = ["FleetFacts", "fleet_summary", "format_fleet_table"]

TIERS = ("device", "host", "l3")
ENGINE_WORDS = {"scheduler": "SGLang's scheduler (requests batched by SGLang, in_flight per deployment)",
                "loop": "the simulator's loop (one request at a time per deployment)"}
#: L3 losses per deployment (simulate's JSON): page writes failed or dropped, pages found present but not
#: read whole, lookups given up at their deadline.
LOSS_KEYS = ("l3_write_failures", "l3_dropped_writes", "l3_read_failures", "l3_timeouts")
#: ... and objects found but refused by the readers' checks (corrupt, short, another namespace).
REFUSED_KEY = "l3_rejected_objects"


@dataclass(frozen=True)
class FleetFacts:
    engine: str  # what ran each deployment: "scheduler" or "loop"
    route: str
    l3_scope: Optional[str]  # None: no L3
    l3_dir: Optional[str]
    page_size: int
    prompt_tokens: list[int]  # per request
    ideal_hit_tokens: list[int]  # per request, one infinite cache over the whole trace
    workload: str


def _share(part: float, whole: float) -> Optional[float]:
    return part / whole if whole else None


def _load_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tiers(dep: Deployment) -> dict[str, int]:
    out = dict.fromkeys(TIERS, 0)
    for device, host, l3 in dep.hits.values():
        l3 = min(l3, host)
        out["device"] += device
        out["host"] += host - l3
        out["l3"] += l3
    return out


def _attribution(deps: list[Deployment], jsons: list[Optional[dict[str, Any]]]) -> list[dict[str, int]]:
    """Per deployment: restored pages by writer (a deployment's name, or ``unknown``)."""
    stored: list[set[str]] = [
        {k for keys in (j or {}).get("l3_stored_keys_per_rank", []) for k in keys} for j in jsons
    ]
    out = []
    for me, j in enumerate(jsons):
        counts: Counter[str] = Counter()
        for keys in (j or {}).get("l3_restored_keys_per_rank", []):
            for key in keys:
                if key in stored[me]:
                    counts[deps[me].name] += 1
                    continue
                writers = [deps[k].name for k in range(len(deps)) if k != me and key in stored[k]]
                counts[writers[0] if writers else "unknown"] += 1
        out.append(dict(sorted(counts.items())))
    return out


def _deployment_fields(dep: Deployment, j: Optional[dict[str, Any]], facts: FleetFacts,
                       requests: Sequence[Sequence[int]], by_writer: dict[str, int],
                       releases: dict[str, str], replay_t0: float) -> dict[str, Any]:
    tiers = _tiers(dep)
    hits = sum(tiers.values())
    served = sorted(dep.done)
    ideal = sum(facts.ideal_hit_tokens[i] for i in served)
    alone = ideal_cache([requests[i] for i in served], facts.page_size).hit_tokens if served else []
    lost = [i for i in dep.sent if i not in dep.done]
    moved = (j or {}).get("bytes_moved", {})
    other = {w: n for w, n in by_writer.items() if w != dep.name}
    return {
        "name": dep.name, "release": dep.spec.release, "cp_size": dep.spec.cp_size, "log": dep.log_path,
        "device_pages": (j or {}).get("device_pages"), "host_pages": (j or {}).get("host_pages"),
        "l3_dir": dep.l3_dir,
        "requests_routed": len(dep.sent), "requests_served": len(served), "requests_lost": len(lost),
        "lost_request_indices": lost[:32],
        "prompt_tokens": sum(facts.prompt_tokens[i] for i in served),
        "hit_tokens": hits, "hit_tokens_per_tier": tiers,
        "ideal_hit_tokens": ideal, "ideal_hit_tokens_alone": sum(alone),
        "hit_ratio": _share(hits, ideal), "hit_ratio_per_tier": {t: _share(n, ideal) for t, n in tiers.items()},
        # scheduler engine, a deployment that finished: its summary's hits per tier, which the requests' must sum to
        "engine_hit_tokens_per_tier": (j.get("hit_tokens_per_tier") if j and j.get("engine") == "scheduler"
                                       and dep.exit_code == 0 else None),
        "l3_restored_pages_by_writer": by_writer,
        "l3_restored_from_other_deployment": sum(n for w, n in other.items() if w != "unknown"),
        "l3_restored_from_other_release": sum(n for w, n in other.items()
                                              if w in releases and releases[w] != dep.spec.release),
        # loop engine: bytes_moved; scheduler engine: what each rank's L3 metered
        "l3_written_bytes": moved.get("l3_write", (j or {}).get("l3_written_bytes", 0)),
        "l3_read_bytes": moved.get("l3_read", (j or {}).get("l3_read_bytes", 0)),
        "l3_written_pages": (j or {}).get("l3_written_pages", 0),
        "l3_kept_pages": (j or {}).get("l3_kept_pages", 0),  # scheduler engine: written again, found sound
        # what the store lost or refused, as this deployment's ranks counted it (0: none, or it died unreported)
        **{key: (j or {}).get(key, 0) for key in (*LOSS_KEYS, REFUSED_KEY)},
        # the ranks' events cover a deployment that died; its JSON, one that never sent them
        "restored_pages_verified": (j or {}).get("restored_pages_verified", 0),
        "verified_pages": dep.verified, "corrupted_pages": max(dep.corrupted, (j or {}).get("corrupted_pages", 0)),
        "ranks_agree": (j or {}).get("ranks_agree"), "ok": bool(j and j.get("ok")) and dep.exit_code == 0,
        "problems": (j or {}).get("problems", []), "exit_code": dep.exit_code,
        "died_at_request": dep.died_at_request if dep.exit_code != 0 else None,
        # where a deployment's replay time went: process CPU per rank, and of it inside SGLang's cache
        # calls (consensus all-reduces included) and writing / checking content
        **{key: (j or {}).get(key) for key in ("cpu_seconds_per_rank", "cache_cpu_seconds_per_rank",
                                               "content_cpu_seconds_per_rank", "collective_cpu_seconds_per_rank")},
        "startup_wall_seconds": (j or {}).get("startup_wall_seconds"),
        "replay_wall_seconds": (j or {}).get("replay_wall_seconds"),
        "series": {"request_index": served,
                   "device_hit_tokens": [dep.hits[i][0] for i in served],
                   "host_hit_tokens": [dep.hits[i][1] for i in served],
                   "l3_hit_tokens": [dep.hits[i][2] for i in served],
                   "ideal_hit_tokens": [facts.ideal_hit_tokens[i] for i in served],
                   # seconds into the replay when rank 0 started and finished each request
                   "start_seconds": [round(dep.started.get(i, replay_t0) - replay_t0, 3) for i in served],
                   "done_seconds": [round(dep.done[i] - replay_t0, 3) for i in served]},
    }


def fleet_summary(run: FleetRun, facts: FleetFacts, requests: Sequence[Sequence[int]],
                  mooncake: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The fleet's JSON summary; ``ok`` and ``problems`` say whether it passed."""
    jsons = [_load_json(d.json_path) for d in run.deployments]
    attribution = _attribution(run.deployments, jsons)
    releases = {d.name: d.spec.release for d in run.deployments}
    per = [_deployment_fields(d, j, facts, requests, a, releases, run.replay_t0)
           for d, j, a in zip(run.deployments, jsons, attribution)]
    tiers = {t: sum(p["hit_tokens_per_tier"][t] for p in per) for t in TIERS}
    hits = sum(tiers.values())
    ideal = sum(facts.ideal_hit_tokens)
    corrupted = sum(p["corrupted_pages"] for p in per)
    problems = []
    for p in per:
        if p["exit_code"] != 0:
            problems.append(f"{p['name']} exited with status {p['exit_code']}: {p['requests_lost']} requests lost "
                            f"(log: {p['log']})")
        problems += [f"{p['name']}: {x}" for x in p["problems"]]
        if p["engine_hit_tokens_per_tier"] not in (None, p["hit_tokens_per_tier"]):
            problems.append(f"{p['name']}: its requests' hits {p['hit_tokens_per_tier']} differ from its "
                            f"scheduler's {p['engine_hit_tokens_per_tier']}")
    if run.unrouted:
        problems.append(f"{len(run.unrouted)} requests found no live deployment")
    if corrupted:
        problems.append(f"{corrupted} corrupted pages")
    verified = sum(p["verified_pages"] for p in per)
    if verified == 0:
        problems.append("no page was verified: the run proves nothing")
    return {
        "engine": facts.engine, "route": facts.route, "l3_scope": facts.l3_scope, "l3_dir": facts.l3_dir,
        "workload": facts.workload, "requests": len(requests), "page_size": facts.page_size,
        "deployments": per,
        "prompt_tokens": sum(facts.prompt_tokens), "ideal_hit_tokens": ideal,
        "hit_tokens": hits, "hit_tokens_per_tier": tiers, "hit_ratio": _share(hits, ideal),
        "hit_ratio_per_tier": {t: _share(n, ideal) for t, n in tiers.items()},
        "requests_lost": sum(p["requests_lost"] for p in per) + len(run.unrouted),
        "l3_restored_from_other_deployment": sum(p["l3_restored_from_other_deployment"] for p in per),
        "l3_restored_from_other_release": sum(p["l3_restored_from_other_release"] for p in per),
        "l3_written_bytes": sum(p["l3_written_bytes"] for p in per),
        "l3_read_bytes": sum(p["l3_read_bytes"] for p in per),
        **{key: sum(p[key] for p in per) for key in (*LOSS_KEYS, REFUSED_KEY)},
        "mooncake": mooncake,
        "store_size": [s.as_dict() for s in run.store_samples],
        "verified_pages": verified, "corrupted_pages": corrupted,
        "startup_wall_seconds": round(run.startup_seconds, 3), "replay_wall_seconds": round(run.replay_seconds, 3),
        "run_wall_seconds": round(run.wall_seconds, 3),
        "ok": not problems, "problems": problems,
    }


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _mooncake_lines(m: Optional[dict[str, Any]]) -> list[str]:
    if m is None:
        return []
    masters = ", ".join(f"{store} {x['address']}" for store, x in m["own_masters"].items()) or m["external_master"]
    lines = [f"Mooncake: master(s) {masters}; {m['segment_bytes_per_rank'] >> 20} MiB segment per CP rank, "
             f"{m['capacity_bytes'] >> 20} MiB mounted; store size = {m['store_size_measures']}"]
    for r in m["master_restarts"]:
        lines.append(f"Mooncake master restarted after request {r['after_request']}: pid {r['old_pid']} -> "
                     f"{r['new_pid']}, objects {r['keys_before']} -> {r['keys_after']} (forgotten: later misses), "
                     f"clients back after {r['clients_back_seconds']} s")
    return lines


def format_fleet_table(s: dict[str, Any]) -> str:
    cols = [*s["deployments"], {"name": "fleet", **s}]
    rows: list[tuple[str, Any]] = [
        ("release / CP", lambda c: f"{c['release']} cp{c['cp_size']}" if "release" in c else "-"),
        ("device / host pages per rank", lambda c: f"{c['device_pages'] or '-'} / {c['host_pages'] or '-'}"
         if "release" in c else "-"),
        ("requests served (lost)", lambda c: f"{c['requests_served']} ({c['requests_lost']})" if "release" in c
         else f"{s['requests'] - s['requests_lost']} ({s['requests_lost']})"),
        ("hits device", lambda c: f"{c['hit_tokens_per_tier']['device']:,}"),
        ("hits host", lambda c: f"{c['hit_tokens_per_tier']['host']:,}"),
        ("hits L3", lambda c: f"{c['hit_tokens_per_tier']['l3']:,}"),
        ("ideal (one infinite cache)", lambda c: f"{c['ideal_hit_tokens']:,}"),
        ("hit_ratio", lambda c: _pct(c["hit_ratio"])),
        ("L3 pages from other deployments", lambda c: f"{c['l3_restored_from_other_deployment']:,}"),
        ("  of which other release", lambda c: f"{c['l3_restored_from_other_release']:,}"),
        ("L3 written / read", lambda c: f"{_mb(c['l3_written_bytes'])} / {_mb(c['l3_read_bytes'])}"),
        ("L3 lost: writes failed / reads failed", lambda c: f"{c['l3_write_failures'] + c['l3_dropped_writes']:,} / "
                                                       f"{c['l3_read_failures']:,}"),
        ("L3 lookups timed out", lambda c: f"{c['l3_timeouts']:,}"),
        ("pages verified / corrupted", lambda c: f"{c['verified_pages']:,} / {c['corrupted_pages']}"),
    ]
    names = [c["name"] for c in cols]
    cells = [[fmt(c) for c in cols] for _, fmt in rows]
    width0 = max(len(label) for label, _ in rows)
    widths = [max(len(n), *(len(r[k]) for r in cells)) for k, n in enumerate(names)]
    lines = [" " * width0 + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths))]
    for (label, _), row in zip(rows, cells):
        lines.append(label.ljust(width0) + "  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)))
    lines.append("")
    lines.append(f"route {s['route']}, L3 scope {s['l3_scope'] or 'none'}, engine: {ENGINE_WORDS[s['engine']]}")
    sizes = ", ".join(f"{x['requests']}: {x['objects']:,} obj {_mb(x['bytes'])}" for x in s["store_size"])
    lines.append(f"L3 store size (requests released: objects, bytes): {sizes or '-'}")
    lines += _mooncake_lines(s.get("mooncake"))
    lines.append(f"wall: start-up {s['startup_wall_seconds']:.1f} s, replay {s['replay_wall_seconds']:.1f} s, "
                 f"run {s['run_wall_seconds']:.1f} s")
    for p in s["problems"]:
        lines.append(f"problem: {p}")
    lines.append("result: OK" if s["ok"] else "result: FAILED")
    return "\n".join(lines)

