"""The tables of docs/results.md, one function per kind of result in
bench/results/ (used by render_results.py, which owns the headline and the
files it writes). Every function marks what it rendered, so the last one
can list everything else. Standard library only."""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

RESULTS = "bench/results"
SIM_KEYS = {"sglang_version", "verified_pages", "corrupted_pages", "ranks_agree"}


@dataclass
class Results:
    """Every file under bench/results, parsed where it is JSON or CSV."""

    root: Path
    files: list[str]
    json: dict[str, Any] = field(default_factory=dict)
    csv: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def take(self, name: str) -> Any:
        self.used.add(name)
        return self.json.get(name, self.csv.get(name))

    def companions(self, name: str) -> list[str]:
        """Files beside ``name`` with its stem (printed table, plot), marked used."""
        stem = name.rsplit(".", 1)[0]
        found = [f for f in self.files if f != name and f.rsplit(".", 1)[0] in (stem, stem + "_d2h", stem + "_h2d")]
        self.used.update(found)
        return found


def load(root: Path) -> Results:
    base = root / RESULTS
    files = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
    res = Results(root, files)
    for name in files:
        path = base / name
        try:
            if name.endswith(".json"):
                res.json[name] = json.loads(path.read_text())
            elif name.endswith(".csv"):
                with path.open(newline="") as f:
                    res.csv[name] = list(csv.DictReader(f))
        except (ValueError, UnicodeDecodeError, csv.Error) as exc:
            res.errors[name] = f"{type(exc).__name__}: {exc}"
    return res


# ---- formatting ---------------------------------------------------------------


def n(value: Any) -> str:
    """An integer with thousands separators; anything else as text; a dash for None."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def signed(x: float) -> str:
    return "0" if x == 0 else f"{x:+g}".replace("-", "−")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def link(name: str) -> str:
    return f"[`{name}`](../{RESULTS}/{name})"


def files_line(res: Results, names: list[str]) -> str:
    shown = []
    for name in names:
        shown += [name, *res.companions(name)]
    return "Files: " + ", ".join(link(x) for x in shown) + "."


def get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def per_rank(values: Any) -> str:
    return ", ".join(n(v) for v in values) if isinstance(values, list) else n(values)


# ---- the simulator on SGLang 0.5.18: CP cache vs non-CP ------------------------

SIM_0518 = re.compile(r"^sim_cp(\d+)(_roomy)?(_greedy)?\.json$")
SIM_0523 = re.compile(r"^sim0523_cp(\d+)_(library|upstream)\.json$")
SIM_L3 = re.compile(r"^(sim|sim0523)_l3_cp(\d+)(?:_to_cp(\d+))?_(write|read)\.json$")


def host_share(d: dict) -> str:
    fractions = get(d, "comparison", "host_slots_fraction_per_rank") or []
    deviation = get(d, "comparison", "host_slots_deviation_pages_per_rank") or []
    if not fractions:
        return "–"
    low, high = min(fractions), max(fractions)
    span = f"{low:.3f} each" if low == high else f"{low:.4f}–{high:.4f}"
    return f"{span} ({', '.join(signed(x) for x in deviation)})"


def section_sim_0518(res: Results) -> list[str]:
    names = sorted((f for f in res.json if SIM_0518.match(f)),
                   key=lambda f: (bool(SIM_0518.match(f).group(2)), bool(SIM_0518.match(f).group(3)),
                                  int(SIM_0518.match(f).group(1))))
    if not names:
        return []
    rows, by_key = [], {}
    for name in names:
        d = res.take(name)
        cp, roomy, greedy = SIM_0518.match(name).groups()
        by_key[(int(cp), bool(roomy), bool(greedy))] = d
        label = f"CP {cp}, " + ("roomy host" if roomy else "host pools full") + (", `greedy`" if greedy else "")
        ar = d.get("all_reduces_per_request") or {}
        copies = d.get("copies") or {}
        rows.append([
            label, f"{n(d.get('verified_pages'))} / {n(d.get('corrupted_pages'))}", host_share(d),
            f"{n(ar.get('cp'))} / {n(ar.get('non_cp'))}", n(d.get("cache_cpu_ratio")),
            f"{n(d.get('device_hit_tokens'))} / {n(get(d, 'non_cp', 'device_hit_tokens'))}",
            f"{n(copies.get('kv_backup_calls'))} / {n(copies.get('kv_load_calls'))} / "
            f"{n(copies.get('indexer_backup_calls'))} / {n(copies.get('indexer_load_calls'))}",
        ])
    out = [
        "## SGLang 0.5.18: the CP cache against non-CP",
        "",
        "400 requests of the synthetic chat, 2 layers, P = 64; CP 4 with 16 device pages per rank, CP 8 "
        "with 8 (the same logical capacity); host pools full (24 / 12 pages per rank) or *roomy* (400 / 200: "
        "nothing is evicted from them); `greedy` = `SGLANG_CP_HICACHE_HOST_BALANCE=greedy`. Non-CP: N TP "
        "processes on one gloo group replaying the same requests. Host share: each rank's peak host slots "
        "over the non-CP peak (goal 1/N), and each rank's distance from 1/N in pages.",
        "",
        *table(["run", "pages verified / corrupted", "host share per rank (pages from 1/N)",
                "all-reduces per request, CP / non-CP", "cache-call CPU, CP / non-CP",
                "device hit tokens, CP / non-CP", "kernel copies: KV backup / load, indexer backup / load"], rows),
        "",
    ]
    notes = []
    for cp in sorted({k[0] for k in by_key}):
        exact, greedy = by_key.get((cp, True, False)), by_key.get((cp, True, True))
        if exact and greedy and greedy.get("device_hit_tokens"):
            cost = 1 - exact["device_hit_tokens"] / greedy["device_hit_tokens"]
            drift = max(abs(x) for x in get(greedy, "comparison", "host_slots_deviation_pages_per_rank") or [0])
            nocp = get(greedy, "non_cp", "device_hit_tokens")
            behind = f"; `greedy` itself hits the device {1 - greedy['device_hit_tokens'] / nocp:.1%} less " \
                     "than non-CP (a restore must land on its owners' lanes)" if nocp else ""
            notes.append(f"* CP {cp}, roomy: the `exact` host balance (the default) costs {cost:.1%} of "
                         f"`greedy`'s device hits; with `greedy` the host shares drift up to {drift:g} pages"
                         f"{behind}.")
    out += notes + ([""] if notes else [])
    out += [
        "A CP rank issues exactly the all-reduces a TP rank does, of the same width (SGLang's per-step "
        "two-word ready-ack all-reduce, with the CP status folded into those words); every copy went "
        "through `sglang_cp_hicache.kernels.transfer` with the run's cp_size.",
        "",
        "```bash",
        ".venv/bin/python -m sglang_cp_hicache simulate --engine loop --cp-size 4 --device-pages 16 --host-pages 24 \\",
        "    --requests 400 --compare-non-cp --json bench/results/sim_cp4.json --plot bench/results/sim_cp4.png",
        ".venv/bin/python -m sglang_cp_hicache simulate --engine loop --cp-size 8 --device-pages 8 --host-pages 12 \\",
        "    --requests 400 --compare-non-cp --json bench/results/sim_cp8.json --plot bench/results/sim_cp8.png",
        "# roomy: --host-pages 400 (CP 4) / 200 (CP 8); greedy: SGLANG_CP_HICACHE_HOST_BALANCE=greedy",
        "```",
        "",
        files_line(res, names),
        "",
    ]
    return out


# ---- the simulator on SGLang 0.5.23: library vs upstream -----------------------


def section_sim_0523(res: Results) -> list[str]:
    names = sorted((f for f in res.json if SIM_0523.match(f)),
                   key=lambda f: (int(SIM_0523.match(f).group(1)), SIM_0523.match(f).group(2) != "upstream"))
    if not names:
        return []
    rows = []
    for name in names:
        d = res.take(name)
        cp, path = SIM_0523.match(name).groups()
        reads = d.get("device_index_host_reads_per_rank") or []
        frees = d.get("request_free_reads_per_rank") or []
        rows.append([
            f"CP {cp}, {n(d.get('device_pages'))} / {n(d.get('host_pages'))}", path,
            f"{n(d.get('write_failures'))} ({n(d.get('backups_attempted'))})", n(d.get("host_hit_tokens")),
            n(d.get("device_hit_tokens")),
            f"{n(d.get('device_evictions'))} ({n(d.get('device_eviction_tokens'))})",
            f"{n(max(reads) if reads else None)} ({n(max(frees) if frees else None)})",
            f"{n(d.get('verified_pages'))} ({n(d.get('restored_pages_verified'))})",
            n(d.get("corrupted_pages")), n(d.get("ranks_agree")),
        ])
    return [
        "## SGLang 0.5.23: the library's copy path against upstream's",
        "",
        "The same workload and pool sizes on SGLang 0.5.23's own KV-sharded pool (host pools full), one run "
        "per copy path. *Node backups refused*: write-through backups that got no host slots (upstream's "
        "one token-sized host eviction can free pages of the wrong owner class). *Host reads of device "
        "locs*: calls of the allocator's `free` that read device tensors on the host (a sync each on a "
        "GPU); in brackets the part both paths share, the scheduler freeing a request's own pages.",
        "",
        *table(["workload (device / host pages per rank)", "path", "node backups refused (attempted)",
                "host hit tokens", "device hit tokens", "device evictions, nodes (tokens)",
                "host reads of device locs per rank (request frees)", "pages verified (restored)",
                "corrupted", "ranks agree"], rows),
        "",
        "```bash",
        ".venv-0523/bin/python -m sglang_cp_hicache simulate --engine loop --cp-size 4 --device-pages 16 --host-pages 24 \\",
        "    --requests 400 --copy library --json bench/results/sim0523_cp4_library.json    # and --copy upstream",
        ".venv-0523/bin/python -m sglang_cp_hicache simulate --engine loop --cp-size 8 --device-pages 8 --host-pages 12 \\",
        "    --requests 400 --copy library --json bench/results/sim0523_cp8_library.json    # and --copy upstream",
        "```",
        "",
        "Eight more workloads (CP 2 to CP 8, other seeds and pool sizes) and the upstream finding: "
        "[sglang-0.5.23.md](sglang-0.5.23.md).",
        "",
        files_line(res, names),
        "",
    ]


# ---- L3 across CP sizes ----------------------------------------------------------


def section_l3(res: Results) -> list[str]:
    names = sorted((f for f in res.json if SIM_L3.match(f)),
                   key=lambda f: (SIM_L3.match(f).group(1) != "sim", SIM_L3.match(f).group(4) == "read",
                                  int(SIM_L3.match(f).group(2)), f))
    if not names:
        return []
    rows = []
    for name in names:
        d = res.take(name)
        prefix, cp, to_cp, kind = SIM_L3.match(name).groups()
        run = f"CP {cp} writes" if kind == "write" else (
            f"CP {to_cp} reads CP {cp}'s" if to_cp else f"CP {cp} reads")
        written = d.get("l3_written_pages_per_rank")
        rows.append([
            n(d.get("sglang_version")), run, f"{per_rank(written)} ({n(d.get('l3_written_pages'))})",
            n(d.get("l3_hit_tokens")), n(d.get("l3_pages_verified")),
            f"{n(d.get('l3_rejected_objects'))} / {n(d.get('corrupted_pages'))}", n(d.get("ranks_agree")),
        ])
    return [
        "## L3 (storage tier) across CP sizes",
        "",
        "A writer fills a fresh L3 directory; each reader runs on a fresh copy of the writer's directory "
        "(0.5.18: CP 2, 1 and 8 each read what CP 4 wrote), with the same logical capacity and requests. A "
        "page is written by whichever rank owned it and read by the rank that will own it.",
        "",
        *table(["SGLang", "run", "L3 pages written per rank (total)", "L3 hit tokens", "L3 pages verified",
                "rejected objects / corrupted pages", "ranks agree"], rows),
        "",
        "Commands: [l3.md](l3.md) and [simulator.md](simulator.md#figures).",
        "",
        files_line(res, names),
        "",
    ]


def _json_section(res: Results, name: str, key: str, render: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """``render(data)`` and the line naming the files, where ``name`` is a
    JSON object with ``key``; nothing otherwise."""
    data = res.json.get(name)
    if not (isinstance(data, dict) and key in data):
        return []
    res.take(name)
    return [*render(data), "", files_line(res, [name]), ""]


def section_l3_bench(res: Results) -> list[str]:
    """bench/bench_l3.py (file store vs HiCacheFile vs raw), bench_l3_mooncake.py
    (copy-free vs copying) and bench_l3_bound.py (a bounded directory)."""
    return (
        _json_section(res, "l3_file.json", "kv", _l3_file)
        + _json_section(res, "l3_mooncake.json", "copy_free_read_GBps", _l3_mooncake)
        + _json_section(res, "l3_bound.json", "lru-leaves", _l3_bound)
        + _json_section(res, "identity_fingerprint.json", "cold_s", _identity)
    )


def _l3_file(f: dict[str, Any]) -> list[str]:
    rows = []
    for kind in ("kv", "indexer"):
        d = f.get(kind) or {}
        for op in ("read", "write"):
            rows.append([f"{kind} ({n(d.get('page_bytes'))} B)", op, n(d.get(f"library_{op}_GBps")),
                         n(d.get(f"library_keyed_{op}_GBps")),
                         n(d.get(f"hicachefile_{op}_GBps")), n(d.get(f"raw_{op}_GBps")),
                         n(d.get(f"library_over_hicachefile_{op}")), n(d.get(f"library_keyed_over_hicachefile_{op}")),
                         n(d.get(f"library_over_raw_{op}"))])
        rows.append([f"{kind}", "read, page cache cold", n(d.get("library_read_cold_GBps")),
                     n(d.get("library_keyed_read_cold_GBps")),
                     n(d.get("hicachefile_read_cold_GBps")), n(d.get("raw_read_cold_GBps")), "", "", ""])
    p = f.get("prefix") or {}
    restore = "; ".join(f"CP {cp}: {n(p.get(f'pages_per_rank_cp{cp}'))} pages, {n(p.get(f'restore_seconds_cp{cp}'))} s "
                        f"hot / {n(p.get(f'restore_seconds_cp{cp}_cold'))} s cold" for cp in (1, 2, 4, 8)
                        if f"restore_seconds_cp{cp}" in p)
    checks = ", ".join(f"{k.replace('_GBps', '')} {n(v)}" for k, v in (f.get("checksums") or {}).items())
    return [
        "## L3 file store: this library vs SGLang's HiCacheFile vs the raw floor",
        "",
        f"`{f.get('command')}` ({n(f.get('cpus'))} CPUs, {n(f.get('threads'))} L3 I/O threads, median of "
        f"{n((f.get('kv') or {}).get('rounds'))} rounds, GB/s of page bytes). Library: each page's object read "
        "straight into its rows of a layer_first host pool (one non-blocking scatter read of header + runs "
        "where the page cache holds it, else into a staging buffer and copied), its header and XXH3-64 "
        "checked there before the page is published; library, keyed: the same with a deployment secret "
        "(`SGLANG_CP_HICACHE_L3_KEY_FILE`), each object's keyed BLAKE3 MAC written and checked instead; "
        "HiCacheFile: SGLang 0.5.18's `batch_get` "
        "into fresh flat pages, then SGLang's own host copy (`set_from_flat_data_page`), nothing "
        "verified; raw: `readinto` a preallocated tensor, one thread, no host pool.",
        "",
        *table(["page", "op", "library", "library, keyed", "HiCacheFile", "raw floor", "library / HiCacheFile",
                "keyed / HiCacheFile", "library / raw"], rows),
        "",
        f"A {n(p.get('prefix_tokens'))}-token DeepSeek-V3.2 prefix ({n(p.get('pages'))} pages of KV and "
        f"indexer objects) restored by one rank into host pools: {restore}. Checksums on 64 MiB, GB/s: "
        f"{checks}.",
        *_macs(f.get("macs") or {}, f.get("threads")),
    ]


def _macs(m: dict[str, Any], threads: Any) -> list[str]:
    """The MAC candidates on one page (``bench_l3.bench_macs``)."""
    names = sorted({k.split("_", 2)[2].rsplit("_GBps", 1)[0] for k in m if k.startswith("kv_runs_") and
                    k.endswith("_GBps")})
    if not names:
        return []
    rows = [[name, *[n(m.get(f"{kind}_runs_{name}_GBps")) for kind in ("kv", "indexer")],
             n(m.get(f"kv_whole_{name}_GBps")), n(m.get(f"kv_runs_{name}_GBps_{threads}threads")),
             n(m.get(f"kv_{name}_us_per_page")), n(m.get(f"indexer_{name}_us_per_page"))] for name in names]
    return [
        "",
        "Each object's tag, on one DeepSeek-V3.2 page streamed as its 61 layer runs (as a host page is checked), "
        "GB/s; the keyed ones are the MAC candidates of `SGLANG_CP_HICACHE_L3_KEY_FILE`:",
        "",
        *table(["tag", "KV page, 1 thread", "indexer page, 1 thread", "KV page whole, 1 thread",
                f"KV page, {n(threads)} threads", "µs per KV page", "µs per indexer page"], rows),
    ]


def _l3_mooncake(m: dict[str, Any]) -> list[str]:
    return [
        "## L3 on Mooncake: copy-free vs copying",
        "",
        f"`{m.get('command')}`: a real `mooncake_master` on loopback (TCP), {n(m.get('pages'))} KV pages of "
        f"{n(m.get('page_bytes'))} B, {n(m.get('local_buffer_size'))} B staging buffer, every page verified.",
        "",
        *table(["path", "write GB/s", "read GB/s"], [
            ["copying (`put` / `get` of joined bytes)", n(m.get("copying_write_GBps")), n(m.get("copying_read_GBps"))],
            ["copy-free (`upsert_parts` / `batch_get_into_multi_buffers`)", n(m.get("copy_free_write_GBps")),
             n(m.get("copy_free_read_GBps"))],
        ]),
    ]


def _identity(d: dict[str, Any]) -> list[str]:
    layout = d.get("layout") or {}
    return [
        "## The L3 model identity's content fingerprint",
        "",
        f"`{d.get('command')}`: {n(layout.get('shards'))} sparse safetensors shards of "
        f"{n(layout.get('shard_bytes'))} B ({n(layout.get('apparent_bytes'))} B in all, "
        f"{n(layout.get('tensors'))} tensors, {n(layout.get('json_bytes'))} B of JSON) fingerprinted with "
        f"{n(d.get('samples_per_file'))} blocks of {n(d.get('block_bytes'))} B per file, "
        f"{n(d.get('read_threads'))} files at a time: {n(d.get('bytes_read'))} B in {n(d.get('read_calls'))} reads; "
        f"{n(d.get('cold_s'))} s with the page cache dropped, {n(d.get('warm_s'))} s warm, "
        f"{n(d.get('cached_s'))} s from the process's cache (median of {len(d.get('cold_s_all') or [])}, "
        f"{n(d.get('cpus'))} CPUs). {d.get('note', '')}.".replace("cold_s", "the first figure"),
    ]


def _l3_bound(b: dict[str, Any]) -> list[str]:
    rows = []
    for policy in ("unbounded", "lru-leaves", "random-chains"):
        d = b.get(policy) or {}
        for role in ("writer", "reader"):
            r = d.get(role) or {}
            rows.append([policy, f"{role} ({'CP 4' if role == 'writer' else 'CP 2, a copy of its directory'})",
                         n(r.get("peak_bytes")), n(r.get("l3_written_pages")), n(r.get("l3_hit_tokens")),
                         n(r.get("l3_pages_verified")), f"{n(r.get('l3_rejected_objects'))} / "
                         f"{n(r.get('corrupted_pages'))}"])
    return [
        "## A bounded L3 directory",
        "",
        f"`{b.get('command')}`: SGLang's `SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE` = {n(b.get('cap_bytes'))} B "
        f"(the cap; the directory may hold it plus one object per writer thread: "
        f"{n(b.get('allowed_peak_bytes'))} B), the directory's bytes sampled every 20 ms. L3 hits with "
        f"chain ends evicted least recently used first over whole chains evicted at random: writer "
        f"{n(b.get('writer_hits_lru_over_random'))}x, reader {n(b.get('reader_hits_lru_over_random'))}x.",
        "",
        *table(["policy", "run", "largest directory seen (B)", "L3 pages written", "L3 hit tokens",
                "L3 pages verified", "rejected objects / corrupted pages"], rows),
    ]


# ---- any other simulator summary (traces, new runs) --------------------------------


def section_traces(res: Results) -> list[str]:
    """The Mooncake conversation trace runs (bench/sim_traces.sh): hits per
    tier against the trace's own ideal, and the non-CP stack of the same
    capacity."""
    names = sorted(f for f in res.json if f.startswith("traces/") and f not in res.used
                   and isinstance(res.json[f], dict) and "ideal_hit_tokens" in res.json[f])
    if not names:
        return []
    rows, ideal, printed = [], None, []
    for name in names:
        d = res.take(name)
        tiers = d.get("hit_tokens_per_tier") or {}
        ideal = d
        efficiency = d.get("capacity_efficiency")
        rows.append([
            link(name), n(d.get("sglang_version")), n(d.get("copy_path")), n(d.get("cp_size")),
            "yes" if tiers.get("l3") else "no", n(tiers.get("device")), n(tiers.get("host")), n(tiers.get("l3")),
            n(d.get("hit_tokens")), f"{d.get('hit_ratio', 0):.3f}",
            "–" if efficiency is None else f"{efficiency:.3f}",
            f"{n(d.get('verified_pages'))} / {n(d.get('corrupted_pages'))}", n(d.get("ranks_agree")),
        ])
        printed += res.companions(name)
    if "traces/README.md" in res.files:
        res.used.add("traces/README.md")
    return [
        "## Mooncake conversation trace",
        "",
        f"The first {n(ideal.get('requests'))} requests of Kimi's production conversation trace (Mooncake "
        f"FAST'25), {n(ideal.get('trace_block_tokens'))} tokens a hash id; ideal (infinite cache, "
        f"page-aligned): {n(ideal.get('ideal_hit_tokens'))} of {n(ideal.get('prompt_tokens'))} prompt tokens. "
        "`hit_ratio` = all hits / ideal; `capacity_efficiency` = CP hits / hits of a non-CP stack of the "
        "same release with N x a rank's pages. How they were made: "
        f"{link('traces/README.md')}.",
        "",
        *table(["file", "SGLang", "copy path", "CP", "L3", "device hits", "host hits", "L3 hits", "all hits",
                "hit_ratio", "capacity_efficiency", "pages verified / corrupted", "ranks agree"], rows),
        "",
        *([f"Printed tables (with the exact command and the run's time): {', '.join(link(x) for x in printed)}.", ""]
          if printed else []),
    ]


def section_other_sims(res: Results) -> list[str]:
    names = [f for f in res.json if f not in res.used and isinstance(res.json[f], dict)
             and SIM_KEYS <= set(res.json[f])]
    if not names:
        return []
    rows = []
    for name in names:
        d = res.take(name)
        rows.append([
            link(name), n(d.get("sglang_version")), n(d.get("copy_path")), n(d.get("cp_size")),
            n(d.get("requests")), n(d.get("workload")), n(d.get("prompt_tokens")),
            n(d.get("device_hit_tokens")), n(d.get("host_hit_tokens")), n(d.get("l3_hit_tokens")),
            f"{n(d.get('verified_pages'))} / {n(d.get('corrupted_pages'))}", n(d.get("ranks_agree")),
        ])
        res.companions(name)
    return [
        "## Other simulator runs",
        "",
        *table(["file", "SGLang", "copy path", "CP", "requests", "workload", "prompt tokens",
                "device hit tokens", "host hit tokens", "L3 hit tokens", "pages verified / corrupted",
                "ranks agree"], rows),
        "",
    ]


# ---- CPU bookkeeping ----------------------------------------------------------------


def section_bookkeeping(res: Results) -> list[str]:
    rows = res.take("bookkeeping.csv") if "bookkeeping.csv" in res.csv else None
    if not rows:
        return []
    p50 = {(r["op"], r["cp_size"], r["tokens"], r["evictable_leaves"]): float(r["p50_us"]) for r in rows}

    def us(op: str, cp: str, tokens: str = "", leaves: str = "") -> str:
        v = p50.get((op, cp, tokens, leaves))
        return "–" if v is None else (f"{v:,.0f} µs" if v >= 100 else f"{v:.1f} µs")

    body = [[label, *(us(op, "2", str(t)) for t in (64, 1024, 16384))] for op, label in (
        ("split", "metadata split"), ("write_plan", "write plan (the cache's page mirror)"),
        ("load_plan", "load plan (owner-preserving alloc, undo log, mirror)"))]
    out = [
        "## CPU cost of the bookkeeping (SGLang 0.5.18 policy)",
        "",
        "p50 of the operations on the path the cache runs, one thread, P = 64; the machine was shared, "
        f"so single figures vary by ±30 %. Python {rows[0].get('python')}, torch {rows[0].get('torch')}.",
        "",
        *table(["operation (cp_size 2)", "1 page", "16 pages", "256 pages"], body),
        "",
    ]
    refused = [(f, us("load_back_refused_undo_log", "8", "1024", f"free={f}"),
                us("load_back_refused_snapshot", "8", "1024", f"free={f}")) for f in ("10000", "100000")]
    evict = [(r["evictable_leaves"], us("host_eviction_k100", "4", "", r["evictable_leaves"]),
              us("rebuild_heap_baseline_k100", "4", "", r["evictable_leaves"]))
             for r in rows if r["op"] == "host_eviction_k100"]
    out += [
        "* Taking a refused load-back back (cp_size 8, 16 pages): the allocator's undo log "
        + "; ".join(f"{u} at {int(f):,} free pages (a snapshot of every free list: {s})" for f, u, s in refused) + ".",
        f"* A new request's 16 pages at cp_size 8: {us('alloc_plain', '8', '1024')} plain, "
        f"{us('alloc_host_biased', '8', '1024')} steered by the host ledger, "
        f"{us('alloc_biased_reclaim_every_page', '8', '1024')} when every page needs an eviction for its lane "
        "(the worst case of the exact host balance; allocator side only).",
        "* Host eviction of 100 leaves out of L evictable ones (the index is kept ordered incrementally): "
        + "; ".join(f"L = {int(l):,}: {e} (rebuilding a heap of every leaf: {h})" for l, e, h in evict) + ".",
        "",
        "```bash",
        ".venv/bin/python bench/bench_bookkeeping.py --out bench/results/bookkeeping.csv",
        "```",
        "",
        files_line(res, ["bookkeeping.csv"]),
        "",
    ]
    return out


# ---- copy bandwidth --------------------------------------------------------------------


def section_transfer(res: Results) -> list[str]:
    out = ["## Copy bandwidth", ""]
    gpu = [f for f in res.files if re.match(r"^(transfer_gpu|gpu_check_)", f)]
    if not gpu:
        out += ["**GPU: not measured yet** -- no GPU result is committed (`make gpu-check` on one GPU writes "
                "`bench/results/gpu_check_<UTC time>/`; see [kernels.md](kernels.md)).", ""]
    rows = res.csv.get("transfer_cpu.csv")
    if rows:
        res.take("transfer_cpu.csv")
        meta = res.take("transfer_cpu.json") if "transfer_cpu.json" in res.json else {}
        cell = {(r["kernel"], r["direction"], r["cp_size"], r["num_pages"]): r for r in rows
                if r["provider"] == "reference"}
        body = []
        for kernel in ("indexer", "kv_fp8", "kv_bf16"):
            for direction in ("d2h", "h2d"):
                for cp in ("1", "8"):
                    got = [cell.get((kernel, direction, cp, p)) for p in ("1", "16", "256")]
                    if any(got):
                        body.append([kernel, direction, cp, *(
                            "–" if r is None else f"{float(r['gbps']):.2f} ({float(r['pct_of_ceiling']):.0f} %)"
                            for r in got)])
        ceiling = meta.get("ceiling_gbps") or {}
        out += [
            "**CPU, the torch reference backend** (the CPU copy path; the correctness oracle, not a fast "
            f"path): {meta.get('device', '?')}, torch {meta.get('torch', '?')}, {meta.get('torch_threads', '?')} "
            f"thread(s), memcpy ceiling {ceiling.get('d2h', 0):.1f} GB/s d2h / {ceiling.get('h2d', 0):.1f} GB/s "
            f"h2d, git `{str(meta.get('git_sha', '?'))[:7]}`. GB/s of the owned pages moved (% of the ceiling); "
            "CP 2 rows are in the CSV.",
            "",
            *table(["buffer", "direction", "CP", "1 logical page", "16 logical pages", "256 logical pages"], body),
            "",
            "```bash",
            ".venv/bin/python bench/bench_transfer.py --cpu --out bench/results",
            "```",
            "",
            files_line(res, ["transfer_cpu.csv"]),
            "",
        ]
    return out


# ---- everything else ------------------------------------------------------------------


def describe(res: Results, name: str) -> str:
    if name in res.errors:
        return f"not readable: {res.errors[name]}"
    if name in res.json:
        d = res.json[name]
        if isinstance(d, dict):
            keys = list(d)
            scalars = [f"`{k}` = {n(v)}" for k, v in d.items() if isinstance(v, (str, int, float, bool))][:4]
            return f"JSON object, {len(keys)} keys ({', '.join(f'`{k}`' for k in keys[:8])}" \
                   f"{', ...' if len(keys) > 8 else ''})" + (f"; {', '.join(scalars)}" if scalars else "")
        if isinstance(d, list):
            return f"JSON list of {len(d)}"
        return f"JSON {type(d).__name__}"
    if name in res.csv:
        rows = res.csv[name]
        return f"CSV, {len(rows)} rows" + (f", columns {', '.join(rows[0])}" if rows else "")
    return f"{name.rsplit('.', 1)[-1] if '.' in name else 'file'}, {(res.root / RESULTS / name).stat().st_size:,} B"


def section_other_files(res: Results) -> list[str]:
    rest = [f for f in res.files if f not in res.used]
    if not rest:
        return []
    return ["## Other files", "", "Not rendered above; listed so that nothing committed goes unseen.", "",
            *table(["file", "what it holds"], [[link(f), describe(res, f)] for f in rest]), ""]


# ---- SGLang 0.5.23: the library against upstream alone (simulate --compare-upstream) ----

COMPARE_UPSTREAM = "sim0523_compare_upstream.json"


def _ratio(p: dict[str, Any], tier: str) -> str:
    value = get(p, "hit_ratio_per_tier", tier)
    return "–" if value is None else f"{value:.3f}"


def what_you_get(res: Results, results_link: str) -> list[str]:
    """The README's "What you get" block: the committed --compare-upstream
    run in plain words, its costs and what it does not measure.
    ``results_link``: the path of bench/results seen from the page."""
    c = res.json.get(COMPARE_UPSTREAM)
    if not (isinstance(c, dict) and isinstance(c.get("paths"), dict)):
        return ["**What you get**: no `--compare-upstream` result is committed yet."]
    lib, up = c["paths"].get("library") or {}, c["paths"].get("upstream") or {}
    sizing = c.get("pool_sizing") or {}
    trace = str(c.get("workload", "")).rsplit("/", 1)[-1]
    text = f"{results_link}/{COMPARE_UPSTREAM.replace('.json', '.txt')}"

    def hits(p: dict[str, Any]) -> str:
        parts = [f"{label} {_ratio(p, tier)}" for tier, label in (("device", "device"), ("host", "host"), ("l3", "L3"))
                 if tier != "l3" or p.get("l3")]
        ratio = p.get("hit_ratio")
        return "–" if ratio is None else f"**{ratio:.3f}** ({', '.join(parts)})"

    rows = [
        ["prefix hits, as a share of what an infinite cache hits", hits(lib), hits(up)],
        ["L3 (storage) tier under KV sharding",
         f"yes: {n(lib.get('l3_written_pages'))} pages written" if lib.get("l3") else "not in this run",
         "refused by SGLang at start-up" if c.get("upstream_l3") else "–"],
        ["write-through backups lost", f"{n(lib.get('backups_lost'))} of {n(lib.get('backups_attempted'))}",
         f"{n(up.get('backups_lost'))} of {n(up.get('backups_attempted'))}"],
        ["host reads of device page indices (a GPU sync each), per rank",
         n(lib.get("device_index_host_reads_max_per_rank")), n(up.get("device_index_host_reads_max_per_rank"))],
    ]
    l3_gb = (lib.get("l3_written_bytes") or 0) / 1e9
    return [
        f"**What you get** on SGLang 0.5.23 with KV sharding (simulator: CP {n(c.get('cp_size'))}, the first "
        f"{n(c.get('requests'))} requests of Mooncake's `{trace}`, host pools sized to hold "
        f"{sizing.get('capacity', 0):g} of the {n(sizing.get('distinct_pages'))} distinct pages they touch, "
        f"device pools half that; [output and command]({text})):",
        "",
        *table(["", "this library", "upstream alone"], rows),
        "",
        f"Costs: the same host KV pool on both paths ({n(c.get('host_pages'))} pages a rank), no extra one; "
        f"the L3 tier's storage ({l3_gb:.2f} GB written here; the OS page cache over it is not counted); "
        f"replay CPU {n(lib.get('replay_cpu_seconds_per_rank'))} s against "
        f"{n(up.get('replay_cpu_seconds_per_rank'))} s a rank on this CPU-only simulator (the library's run also "
        f"writes every page to L3, restores from it, and checks the {n(lib.get('verified_pages'))} pages it "
        f"reused against upstream's {n(up.get('verified_pages'))}). Not measured: GPU copy time, restore "
        "latency, L3 reads from real shared storage, a real server.",
    ]


def section_compare_upstream(res: Results) -> list[str]:
    if COMPARE_UPSTREAM not in res.json:
        return []
    c = res.take(COMPARE_UPSTREAM)
    return [
        "## SGLang 0.5.23: the library against upstream alone",
        "",
        *what_you_get(res, f"../{RESULTS}"),
        "",
        f"`{c.get('command')}`" if isinstance(c, dict) else "",
        "",
        files_line(res, [COMPARE_UPSTREAM]),
        "",
    ]
