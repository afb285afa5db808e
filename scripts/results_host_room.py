"""docs/results.md's host-room table and the headline's host-room row, from
bench/results/host_room.json (bench/bench_host_room.py): upstream's path and
the library's three host-room rules on the same ten workloads. Standard
library only."""

from __future__ import annotations

from typing import Any, Optional

from results_sections import Results, files_line, n, table

HOST_ROOM = "host_room.json"
VARIANTS = ("upstream", "whole", "shortest", "covering")
TITLES = {"upstream": "upstream", "whole": "library, whole leaf", "shortest": "library, shortest tail",
          "covering": "library, covering tail (default)"}


def _complete(doc: Any) -> list[dict[str, Any]]:
    """The workloads every variant ran, in the sweep's order."""
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), dict):
        return []
    runs = [r for r in doc["runs"].values() if isinstance(r, dict) and all(isinstance(r.get(v), dict)
                                                                          for v in VARIANTS)]
    return sorted(runs, key=lambda r: r.get("index", 0))


def totals(res: Results) -> Optional[dict[str, Any]]:
    """Host-hit tokens and write failures summed per variant, the workload
    count, and whether every run restored bit-exact with agreeing ranks."""
    runs = _complete(res.json.get(HOST_ROOM))
    if not runs:
        return None
    sums = {v: sum(r[v]["host_hit_tokens"] for r in runs) for v in VARIANTS}
    failures = {v: sum(r[v]["write_failures"] for r in runs) for v in VARIANTS}
    covering_at_least = sum(r["covering"]["host_hit_tokens"] >= max(r["upstream"]["host_hit_tokens"],
                                                                    r["whole"]["host_hit_tokens"]) for r in runs)
    clean = all(r[v]["corrupted_pages"] == 0 and r[v]["ranks_agree"] and r[v]["ok"] for r in runs for v in VARIANTS)
    return {"workloads": len(runs), "hits": sums, "failures": failures, "covering_at_least": covering_at_least,
            "clean": clean}


def headline_row(res: Results) -> Optional[list[str]]:
    t = totals(res)
    if t is None:
        return None
    h, f = t["hits"], t["failures"]
    return [f"0.5.23 host room, {t['workloads']} synthetic workloads (CP 2-8): host-hit tokens, backups lost",
            f"library (default rule) {n(h['covering'])}, upstream {n(h['upstream'])}, whole-leaf eviction "
            f"{n(h['whole'])}; at least both on {t['covering_at_least']} of {t['workloads']}; backups lost "
            f"{n(f['covering'])} against upstream's {n(f['upstream'])}"]


def section_host_room(res: Results) -> list[str]:
    if HOST_ROOM not in res.json:
        return []
    doc = res.take(HOST_ROOM)
    runs = _complete(doc)
    t = totals(res)
    rows = []
    for r in runs:
        cells = [f"CP {r['cp']}, {r['device_pages']} / {r['host_pages']}, seed {r['seed']}"]
        best = max(r[v]["host_hit_tokens"] for v in VARIANTS)
        for v in VARIANTS:
            hits = n(r[v]["host_hit_tokens"])
            cells.append(f"**{hits}**" if r[v]["host_hit_tokens"] == best else hits)
        cells.append(" / ".join(n(r[v]["write_failures"]) for v in VARIANTS))
        c = r["covering"]
        cells.append(f"{n(c['verified_pages'])} ({n(c['restored_pages_verified'])}), {n(c['corrupted_pages'])}")
        cells.append("yes" if all(r[v]["ranks_agree"] and r[v]["invariant_violations"] == 0 for v in VARIANTS)
                     else "NO")
        rows.append(cells)
    if t is not None:
        rows.append(["**total**", *(n(t["hits"][v]) for v in VARIANTS),
                     " / ".join(n(t["failures"][v]) for v in VARIANTS), "", ""])
    first = runs[0][VARIANTS[-1]]["command"] if runs else ""
    return [
        "## SGLang 0.5.23: host room, upstream against the library's three rules",
        "",
        "`.venv-0523/bin/python bench/bench_host_room.py --out bench/results/host_room.json`: synthetic chat, "
        f"{n(doc.get('requests'))} requests, 2 layers, each workload "
        "through upstream's path and the library's with `SGLANG_CP_HICACHE_HOST_TAIL` `whole`, `shortest` and "
        "`covering` (the default). Host-hit tokens; the most on a workload in bold. The first four workloads were "
        "studied while the rules were written, the last six chosen before their results were seen.",
        "",
        *table(["workload (per rank: device / host pages)", *(TITLES[v] for v in VARIANTS),
                "backups lost: " + " / ".join(VARIANTS), "default rule: pages verified (restored), corrupted",
                "ranks agree, no invariant violated"], rows),
        "",
        f"Each run: `{first}` (the workload's flags; `--copy upstream` without the variable; the loop engine, "
        "the default when it ran: `--engine loop` now)." if first else "",
        "",
        files_line(res, [HOST_ROOM]),
        "",
    ]
