"""Stateful property test on SGLang 0.5.23's KV-sharded DSA HiCache stack:
random requests (new chains, shared prefixes, unaligned tails, repeats that
load back from host), device and host evictions, locks held across steps,
on N rank processes (gloo) each holding upstream's copy path and this
library's side by side (``machine_rank.py``).

After every step, on every rank and for both paths:

* the ranks agree: one tree digest (keys, logical device locs, logical host
  slots, evicted / backed up, rotation base, lock counts) per path;
* the paths agree: the same digest and byte-identical device and host
  buffers -- until a backup makes host room on either path. There the
  library's owner-aware host room evicts by owner class where upstream
  evicts LRU by tokens (upstream finding 1, ``docs/sglang-0.5.23.md``), so
  from that step on the example checks each path on its own; the run counts
  the steps compared across paths and requires most of them;
* no leaks: device tokens in use equal the tree's device tokens, logical
  host slots in use equal the tree's host slots; host pages keep their
  device pages' owners; every ack consumed;
* every byte exact: each device-resident node's owned pages (KV rows and
  indexer rows, every layer) hold the content written for its tokens, so
  every restored byte is checked, and no served request saw a corrupted page.

Profiles: HYPOTHESIS_PROFILE=ci (default) runs >= 5000 steps, derandomized;
=dev explores randomly (``--hypothesis-seed=N`` repeats a run) with
STATE_MACHINE_EXAMPLES examples. Every run prints its step count (``-s``)
and, when STATE_MACHINE_REPORT names a file, appends it there as a JSON line,
failed runs included: ``make soak`` runs this test with random seeds. The
library's copies run on the backend the environment picks (the torch
reference; Triton's interpreter with TRITON_INTERPRET=1, about ten times
slower).
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tests.helpers.sglang_0523.machine_rank import PATHS, make_rank
from tests.helpers.sglang_0523.rank_pool import RankPool
from tests.helpers.state_machine_runs import chosen_profile, run_and_report

P = 64
# Steps per example vary with the data (hypothesis stops an example early
# now and then); the ci run stays clear of 5000 steps and, rank start-up
# and one stack build per example included, under two minutes here.
# compared: the least share of steps compared across copy paths (host
# pressure ends the comparison of an example; ci's stream is fixed, dev's random).
PROFILES = {
    "ci": dict(examples=24, steps=240, min_total=5000, cp_sizes=(2, 3), compared=0.5),
    "dev": dict(examples=40, steps=300, min_total=6000, cp_sizes=(2, 3, 4), compared=0.25),
}
STEPS = {"total": 0, "compared": 0}
POOLS: dict[int, RankPool] = {}


def pool(cp_size: int) -> RankPool:
    """The rank processes of one CP size, started once per test run."""
    existing = POOLS.get(cp_size)
    if existing is None or not existing.alive:
        POOLS[cp_size] = RankPool(make_rank, cp_size)
    return POOLS[cp_size]


def close_pools() -> None:
    while POOLS:
        POOLS.popitem()[1].close()


class ShardedCacheMachine(RuleBasedStateMachine):
    cp_sizes: tuple[int, ...] = (2, 3)

    def __init__(self) -> None:
        super().__init__()
        self.pool: RankPool | None = None
        self.seqs: list[list[int]] = []
        self.locks = 0
        self.next_token = 1
        self.diverged = False  # a backup made host room: the paths may differ from here on

    @initialize(
        data=st.data(),
        device_pages=st.integers(3, 6),
        host_extra=st.integers(0, 20),
        host_layout=st.sampled_from(["layer_first", "page_first"]),
        num_layers=st.integers(1, 2),
        seed=st.integers(0, 2**16),
    )
    def build(self, data, device_pages, host_extra, host_layout, num_layers, seed):
        cp_size = data.draw(st.sampled_from(self.cp_sizes), label="cp_size")
        self.pool = pool(cp_size)
        results = self.pool.call("build", device_pages=device_pages, host_pages=device_pages + host_extra,
                                 host_layout=host_layout, num_layers=num_layers, seed=seed)
        self._check(results, "build")

    def teardown(self):
        if self.pool is not None and self.pool.alive:
            self.pool.call("close")

    # ---- the step protocol -----------------------------------------------------------
    def _step(self, name: str, **kwargs) -> list[dict]:
        STEPS["total"] += 1
        results = self.pool.call(name, **kwargs)
        self._check(results, name)
        return results

    def _check(self, results: list[dict], step: str) -> None:
        for name in PATHS:
            digests = {r[name]["digest"] for r in results}
            assert len(digests) == 1, f"{step}: ranks disagree on the {name} tree: {digests}"
            for rank, r in enumerate(results):
                where = f"{step}, {name} path, rank {rank}"
                assert r[name]["violations"] == [], f"{where}: leaks or owners: {r[name]['violations']}"
                assert r[name]["bad_pages"] == [], f"{where}: device bytes not as written: {r[name]['bad_pages']}"
                records = r["records"] or {}
                if isinstance(records.get(name), tuple):
                    assert records[name][5] == 0, f"{where}: the request's prefix held corrupted pages"
        self.diverged = self.diverged or any(r[p]["room_frees"] for r in results for p in PATHS)
        if self.diverged:
            return
        STEPS["compared"] += 1
        for rank, r in enumerate(results):
            up, lib = r["upstream"], r["library"]
            where = f"{step}, rank {rank}"
            assert up["digest"] == lib["digest"], f"{where}: the copy paths' trees differ"
            assert r["records"] is None or r["records"]["upstream"] == r["records"]["library"], \
                f"{where}: the copy paths' steps differ: {r['records']}"
            assert r["same_device_bytes"], f"{where}: device bytes differ across copy paths"
            assert r["same_host_bytes"], f"{where}: host bytes differ across copy paths"

    def _fresh(self, n: int) -> list[int]:
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    # ---- rules -------------------------------------------------------------------------
    @rule(pages=st.integers(0, 3), tail=st.sampled_from([0, 0, 1, 17, 63]), base=st.integers(0, 1000),
          share=st.integers(0, 3))
    def new_request(self, pages, tail, base, share):
        prefix: list[int] = []
        if self.seqs and share:
            parent = self.seqs[base % len(self.seqs)]
            prefix = parent[: min(share, len(parent) // P) * P]
        tokens = prefix + self._fresh(pages * P + tail)
        if not tokens:
            tokens = self._fresh(P)
        self._step("request", tokens=tokens)
        if len(tokens) >= P:
            self.seqs.append(tokens)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000), cut=st.integers(0, 6))
    def repeat_request(self, i, cut):
        """An earlier request again, or a page-aligned prefix of it: host hits load back."""
        tokens = self.seqs[i % len(self.seqs)]
        if cut:
            tokens = tokens[: min(cut, len(tokens) // P) * P]
        self._step("request", tokens=tokens)

    @rule(pages=st.integers(1, 8))
    def evict_device(self, pages):
        self._step("evict_device", num_tokens=pages * P)

    @rule(pages=st.integers(1, 6))
    def evict_host(self, pages):
        self._step("evict_host", num_tokens=pages * P)

    @precondition(lambda self: self.seqs and self.locks < 2)
    @rule(i=st.integers(0, 1000))
    def lock(self, i):
        self._step("lock", tokens=self.seqs[i % len(self.seqs)])
        self.locks += 1

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 1000))
    def unlock(self, i):
        self._step("unlock", index=i % self.locks)
        self.locks -= 1

    @rule()
    def events(self):
        self._step("events")


@pytest.fixture(scope="module", autouse=True)
def _rank_pools():
    """Rank processes are shared by this file's tests and ended after them."""
    yield
    close_pools()


@pytest.mark.parametrize("part", ["kv", "indexer", "host"])
def test_the_checks_catch_one_flipped_byte(part):
    """A byte flipped on the library path: the step's check fails (device:
    the node's content and the cross-path comparison; host: the comparison)."""
    ranks = pool(2)
    ranks.call("build", device_pages=4, host_pages=8, host_layout="page_first", num_layers=1, seed=5)
    machine = ShardedCacheMachine()
    machine.pool = ranks
    machine._check(ranks.call("request", tokens=list(range(1, 3 * P + 1))), "request")
    results = ranks.call("sabotage", path="library", part=part)
    with pytest.raises(AssertionError, match="device bytes not as written|bytes differ across copy paths"):
        machine._check(results, "sabotage")
    if part != "host":
        assert any(r["library"]["bad_pages"] for r in results)  # not only the comparison
    ranks.call("close")


@pytest.mark.slow(120)
def test_sharded_cache_state_machine_0523():
    name, profile = chosen_profile(PROFILES)
    STEPS["total"] = STEPS["compared"] = 0
    ShardedCacheMachine.cp_sizes = profile["cp_sizes"]
    run_and_report(
        ShardedCacheMachine, name, profile, STEPS,
        extra=lambda: {"compared_across_paths": STEPS["compared"]},
        note=lambda: f"{STEPS['compared']} compared across copy paths; ",
    )
    assert STEPS["total"] >= profile["min_total"], STEPS
    # the differential half must not be vacuous
    assert STEPS["compared"] >= profile["compared"] * STEPS["total"], STEPS
