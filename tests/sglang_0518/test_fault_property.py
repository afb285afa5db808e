"""The promise of a raised step, as a property: a fault at a random point of a
random step -- a host allocation short, a backup copy or its submission
raising, planning a write raising after its slots were taken, a device
allocation failing,
preparing or running a load's copy raising; on one rank or several; writes
and load-backs in flight together, requests splitting and extending the
restored nodes, loads left queued by a dropped batch -- and then:

* either no rank raises (only host allocations came up short: those writes
  are taken back quietly) or every rank raises :class:`CpHiCacheTransferError`;
* after a raise, every rank's tree (page by page: device page, host slots
  and owners, locks, write state), leaf sets, sizes, allocator, host pool,
  ledger, controller queues, operations in flight and page mirrors equal
  what they were before the step (:func:`rank_state`);
* the ranks agree with each other (:func:`shared_view`, exact allocator lists);
* the caller retries the same step: it succeeds, and every byte on the
  device and (restored again after evicting everything) on the host is the
  one written -- free pages are scribbled over first, so a copy that did not
  happen cannot pass.

Steps are sized so that nothing needs evicting: a raised step does not undo
evictions (every rank makes the same ones, see test_take_backs).
The ``ci`` hypothesis profile runs 60 examples (derandomized).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from sglang.srt.mem_cache.hicache_storage import PoolName

from sglang_cp_hicache.placement import page_owner
from sglang_cp_hicache.sglang_0518.hiradix import CpHiCacheTransferError
from sglang_cp_hicache.testing.content import write_content
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.cp_cluster import SEED, CpCluster
from tests.helpers.rank_snapshot import FailOn, exact_allocator, rank_state, shared_view

P = 64
FAULTS = {  # kind -> whether it makes every rank raise
    "host_short": False,
    "backup_raises": True,
    "write_submit_raises": True,
    "write_plan_raises": True,
    "device_alloc_fails": True,
    "load_prep_raises": True,
    "load_copy_raises": True,
}
WRITE_FAULTS = ("host_short", "backup_raises", "write_submit_raises", "write_plan_raises")
LOAD_FAULTS = ("device_alloc_fails", "load_prep_raises", "load_copy_raises")


@dataclass(frozen=True)
class Fault:
    kind: str
    ranks: frozenset
    call: int  # which matching call on each of those ranks fails (0-based)


@dataclass(frozen=True)
class Scenario:
    cp_size: int
    groups: tuple  # restorable chains: (pages of the base, pages of an extension or 0)
    writable: tuple  # pages of sequences on the device, not backed up yet
    ops: tuple  # ("load", group, start) / ("write", i) / ("extend" | "split", group)
    faults: tuple


@st.composite
def scenarios(draw) -> Scenario:
    cp_size = draw(st.sampled_from([2, 3]))
    groups = tuple(draw(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=3)))
    writable = tuple(draw(st.lists(st.integers(1, 2), max_size=3)))
    ops = []
    for g in draw(st.lists(st.sampled_from(range(len(groups))), unique=True, min_size=1)):
        ops.append(("load", g, draw(st.booleans())))
        built = draw(st.sampled_from(["none", "extend", "split"]))
        if built == "extend" or (built == "split" and groups[g][0] + groups[g][1] > 1):
            ops.append((built, g))
    ops += [("write", i) for i in range(len(writable)) if draw(st.booleans())]
    ops = draw(st.permutations(ops))
    # A request built on a restored chain comes after its load-back.
    ops = sorted(ops, key=lambda op: (op[0] in ("extend", "split"),))
    # Faults where the step has calls to fail (every request below a
    # restored node backs its new leaf up).
    kinds = LOAD_FAULTS + (WRITE_FAULTS if any(op[0] != "load" for op in ops) else ())
    faults = tuple(draw(st.lists(
        st.builds(Fault, st.sampled_from(kinds),
                  st.frozensets(st.integers(0, cp_size - 1), min_size=1), st.sampled_from([0, 0, 1])),
        min_size=1, max_size=2,
    )))
    return Scenario(cp_size, groups, writable, tuple(ops), faults)


class World:
    """A cluster built for one scenario, with its token sequences."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.cl = CpCluster(CpStackConfig(cp_size=sc.cp_size, device_pages=18, host_pages=20, num_layers=1),
                            threaded=True, timeout_s=60)
        self._next = 1
        self.chains = []  # the deepest sequence of each restorable group
        for base, ext in sc.groups:
            tokens = self.fresh(base)
            self.cl.insert(tokens)
            if ext:
                tokens = tokens + self.fresh(ext)
                self.cl.insert(tokens)
            self.chains.append(tokens)
        self.cl.evict_device(10**6)
        self.writable = []
        for pages in sc.writable:
            self.writable.append(self.fresh(pages))
            self.cl.insert_resident(self.writable[-1])
        self.requests = {op: self.request(op) for op in sc.ops if op[0] in ("extend", "split")}

    def fresh(self, pages: int) -> list[int]:
        tokens = list(range(self._next, self._next + pages * P))
        self._next += pages * P
        return tokens

    def request(self, op) -> list[int]:
        chain = self.chains[op[1]]
        return chain + self.fresh(1) if op[0] == "extend" else chain[:P] + self.fresh(2)

    def sequences(self) -> list:
        return [*self.chains, *self.writable, *self.requests.values()]

    def step(self, *, start_all: bool):
        """The scenario's step on every rank, ending in SGLang's per-step
        all-reduce; ``start_all``: start every load (the retry)."""
        inserts = {op: self.cl._insert_fn(tokens, check=False) for op, tokens in self.requests.items()}
        writes = [self.cl._insert_fn(tokens, check=False) for tokens in self.writable]

        def run(s):
            for op in self.sc.ops:
                if op[0] == "load":
                    self.cl.start_load_back(s, self.chains[op[1]], start=op[2] or start_all)
                elif op[0] == "write":
                    writes[op[1]](s)
                else:
                    inserts[op](s)
            s.cache.check_hicache_events()

        return self.cl.each(run, return_exceptions=True)


def install(stack, fault: Fault) -> tuple:
    """Wrap the call ``fault`` makes fail on one rank; (object, name, original)."""
    cache = stack.cache
    ctrl = cache.cache_controller
    exc = RuntimeError(f"{fault.kind} (injected)")
    calls = (fault.call,)
    kv_host = cache.token_to_kv_pool_host.anchor_entry.host_pool
    indexer_host = cache.token_to_kv_pool_host.entry_map[PoolName.INDEXER].host_pool
    target, name, wrap = {
        "host_short": (ctrl.mem_pool_host, "alloc", lambda f: FailOn(f, calls)),
        "backup_raises": (kv_host, "backup_from_device_all_layer", lambda f: FailOn(
            f, calls, exc=exc, when=lambda pool, host, *a: host.numel() > 0)),
        "write_submit_raises": (ctrl, "start_writing", lambda f: FailOn(f, calls, exc=exc)),
        "write_plan_raises": (ctrl, "_resolve_pool_transfers_allocation", lambda f: FailOn(
            f, calls, exc=exc, when=lambda pools, alloc_host, **kw: alloc_host)),
        "device_alloc_fails": (stack.allocator, "alloc_with_owners_mirrored", lambda f: FailOn(f, calls)),
        "load_prep_raises": (ctrl, "_resolve_pool_transfers_allocation", lambda f: FailOn(
            f, calls, exc=exc, when=lambda pools, alloc_host, **kw: not alloc_host)),
        "load_copy_raises": (indexer_host, "load_to_device_per_layer", lambda f: FailOn(f, calls, exc=exc)),
    }[fault.kind]
    original = getattr(target, name)
    setattr(target, name, wrap(original))
    return target, name, original


def scribble_free_pages(cl: CpCluster) -> None:
    """Wrong bytes into every free device page (on the rank owning it)."""
    for s in cl.stacks:
        placement = s.allocator.placement
        free = [p for lane in exact_allocator(s.allocator)[:2] for pages in lane for p in pages]
        mine = torch.tensor([p for p in free if page_owner(p, placement.cp_size) == placement.cp_rank], dtype=torch.int64)
        if mine.numel():
            locs = (mine[:, None] * P + torch.arange(P)).reshape(-1)
            write_content(s.kv_pool, placement.logical_locs_to_physical(locs), locs + 10**7, seed=SEED + 1)


def assert_ranks_agree(cl: CpCluster) -> None:
    views = [shared_view(rank_state(s)) for s in cl.stacks]
    for key in views[0]:
        assert all(v[key] == views[0][key] for v in views), f"ranks differ in {key}"
    assert len({repr(exact_allocator(s.allocator)) for s in cl.stacks}) == 1, "allocator lists differ"


def assert_bytes(world: World) -> None:
    """Every on-device byte, then every sequence restored from the host."""
    cl = world.cl
    for tokens in world.sequences():
        assert cl.check(tokens) == {}, "device bytes"
    cl.evict_device(10**6)
    scribble_free_pages(cl)
    for tokens in world.sequences():
        cl.load_back(tokens)
        assert cl.check(tokens) == {}, "restored bytes"
    assert_ranks_agree(cl)


@pytest.mark.slow(20)
@given(scenarios())
def test_a_raised_step_leaves_every_rank_as_it_was_and_the_retry_is_bit_exact(sc):
    world = World(sc)
    cl = world.cl
    try:
        before = [rank_state(s) for s in cl.stacks]
        installed = [(f, install(cl.stacks[r], f)) for f in sc.faults for r in sorted(f.ranks)]
        outcomes = world.step(start_all=False)
        must_raise = False
        for fault, (target, name, original) in reversed(installed):
            fired = getattr(target, name).fired > 0
            must_raise |= FAULTS[fault.kind] and fired
            event(f"{fault.kind}: {'fired' if fired else 'not reached'}")
            setattr(target, name, original)
        event("every rank raised" if must_raise else "no rank raised")
        raised = [isinstance(o, CpHiCacheTransferError) for o in outcomes]
        assert not any(isinstance(o, Exception) and not r for o, r in zip(outcomes, raised)), outcomes
        assert raised == [must_raise] * sc.cp_size, f"expected every rank to raise: {must_raise}; {outcomes}"
        if must_raise:
            for s, b in zip(cl.stacks, before):
                after = rank_state(s)
                for key in b:
                    assert after[key] == b[key], f"cp_rank {s.cp_rank}: {key} differs from before the step"
            assert_ranks_agree(cl)
            scribble_free_pages(cl)
            retry = world.step(start_all=True)
            assert not any(isinstance(o, Exception) for o in retry), retry
        else:  # at most host allocations came up short: those writes were taken back quietly
            cl.each(lambda s: s.cache.ready_to_load_host_cache())
        cl.step()
        assert_ranks_agree(cl)
        assert_bytes(world)
    finally:
        cl.close()
