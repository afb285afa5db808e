"""docs/results.md's section on the two simulator engines side by side, from
bench/results/engines/*.json (bench/sim_engines.sh): the loop engine (one
request at a time) and the scheduler engine (SGLang's real Scheduler and
event loop) on the same trace, releases and copy paths. Standard library only."""

from __future__ import annotations

from typing import Any

from results_sections import Results, files_line, n, table

PREFIX = "engines/"
ORDER = ("0518", "0523-library", "0523-upstream")


def _names(res: Results) -> list[str]:
    names = [f for f in res.json if f.startswith(PREFIX) and isinstance(res.json[f], dict)
             and "hit_tokens_per_tier" in res.json[f]]

    def key(name: str) -> tuple[int, str]:
        stem = name[len(PREFIX):].rsplit(".", 1)[0]
        setup = stem.rsplit("-", 1)[0]
        return (ORDER.index(setup) if setup in ORDER else len(ORDER), stem)

    return sorted(names, key=key)


def _ratio(d: dict[str, Any]) -> str:
    value = d.get("hit_ratio")
    return "–" if value is None else f"{value:.3f}"


def _seconds(d: dict[str, Any]) -> str:
    value = d.get("replay_wall_seconds")
    return "–" if value is None else f"{value:.0f}"


def section_engines(res: Results) -> list[str]:
    names = _names(res)
    if not names:
        return []
    rows, first = [], None
    for name in names:
        d = res.take(name)
        first = first or d
        sched = d.get("engine") == "scheduler"
        tiers = d.get("hit_tokens_per_tier") or {}
        loads = (f"{n(d.get('load_backs'))} / {n(d.get('load_back_declined_tokens'))}" if sched
                 else f"{n(d.get('load_backs'))} / {n(d.get('load_backs_refused'))} refused")
        rows.append([
            f"[{name[len(PREFIX):]}](../bench/results/{name})", n(d.get("engine")), n(d.get("sglang_version")),
            n(d.get("copy_path")), n(tiers.get("device")), n(tiers.get("host")), _ratio(d),
            n(d.get("batches")) if sched else "one per request", n(d.get("chunks")) if sched else "–", loads,
            n(d.get("corrupted_pages")), n(d.get("ranks_agree")), _seconds(d), n(d.get("ok")),
        ])
    return [
        "## Both simulator engines on the conversation trace",
        "",
        f"`bench/sim_engines.sh`: the first {n(first.get('requests'))} requests of the Mooncake conversation "
        f"trace, CP {n(first.get('cp_size'))}, pools sized from the trace; ideal "
        f"{n(first.get('ideal_hit_tokens'))} hit tokens of {n(first.get('prompt_tokens'))}. The loop engine "
        "replays one request at a time; the scheduler engine runs SGLang's own Scheduler and event loop in "
        "each rank (closed-loop arrivals, at most 8 in flight, chunks of 1,024 tokens) with a forward "
        "stand-in checking every prefix row on its owner, and SGLang's idle leak checks. Load-backs: count / "
        "declined tokens (scheduler) or refused load-backs (loop). A rerun of the scheduler engine gives the "
        "same batches and chunks (no timing decides a batch). Replay seconds are wall time on the "
        "shared two-core machine (the scheduler engine also checks a chunked request's whole prefix again "
        "before every chunk), not a performance figure.",
        "",
        *table(["run", "engine", "SGLang", "copy", "device hits", "host hits", "hit_ratio", "batches",
                "chunks", "load-backs", "corrupted", "ranks agree", "replay s", "ok"], rows),
        "",
        files_line(res, names),
        "",
    ]


STOCK = "stock_scheduler/"


def section_stock_scheduler(res: Results) -> list[str]:
    """The library's CP cache against SGLang's own default cache at CP 1, same logical pools, both under
    SGLang 0.5.18's real Scheduler (bench/sim_stock_scheduler.sh)."""
    names = sorted(f for f in res.json if f.startswith(STOCK) and isinstance(res.json[f], dict))
    if not names:
        return []
    rows = []
    for name in names:
        d = res.take(name)
        tiers = d.get("hit_tokens_per_tier") or {}
        cache = n(d.get("tree_cache"))
        rows.append([
            f"[{name[len(STOCK):]}](../bench/results/{name})", n(d.get("cp_size")),
            cache + (" (the library)" if cache.startswith("Cp") else " (SGLang's default)"),
            n(d.get("device_pages")), n(d.get("host_pages")), n(tiers.get("device")), n(tiers.get("host")),
            _ratio(d), n(d.get("load_back_declined_tokens")), n(d.get("corrupted_pages")), n(d.get("ok")),
        ])
    return [
        "## The library against SGLang's own cache, under the real scheduler (0.5.18)",
        "",
        "`bench/sim_stock_scheduler.sh`: the simulator's synthetic chat workload (120 requests, seed 0) through "
        "SGLang 0.5.18's real Scheduler (`simulate --engine scheduler`), the library's CP cache at CP 2 "
        "against the cache SGLang builds by itself at CP 1, with the same logical pools (19 usable device "
        "pages, 60 host pages). Device and host pages are per rank. Batching depends on when outputs reach "
        "the driver, so a rerun can differ by a page of hits.",
        "",
        *table(["run", "CP", "tree cache", "device pages", "host pages", "device hits", "host hits", "hit_ratio",
                "declined tokens", "corrupted", "ok"], rows),
        "",
        files_line(res, names),
        "",
    ]
