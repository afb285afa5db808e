"""Malformed input to the host-tier policy API: the host slot ledger, placement
sizes, node metadata (host slots, owners and owned positions must agree),
host eviction and load-back. Every call answers with ValueError or TypeError
naming the argument and leaves every object as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.policy_0518.host_eviction import HostLeafIndex, HostSlotLedger, evict_host_slots
from sglang_cp_hicache.policy_0518.load_back import cp_load_back
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import set_host_state
from sglang_cp_hicache.testing.tree_nodes import Node, attach, child_key


def expect_named_error(name: str, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"{name!r} not named in: {info.value}"


# ---- host slot ledger: one non-negative int per rank, never over capacity --------

bad_counts = st.one_of(
    st.lists(st.integers(0, 2), max_size=1),  # too short: zip would drop a rank
    st.lists(st.integers(0, 2), min_size=3, max_size=5),  # too long
    st.lists(st.integers(-5, 2), min_size=2, max_size=2).filter(lambda c: min(c) < 0),
    st.just([1, True]),
    st.just([1.0, 0]),
    st.just([None, 0]),
    st.just("12"),
    st.just(None),
    st.just(3),
    st.just(torch.tensor([1, 0])),
)


@given(counts=bad_counts, call=st.sampled_from(["charge", "release", "shortfall", "fits"]))
def test_ledger_counts_must_list_one_count_per_rank(counts, call):
    ledger = HostSlotLedger([4, 4], used=[2, 2])
    name = "counts" if call in ("charge", "release") else "need"
    expect_named_error(name, getattr(ledger, call), counts)
    assert (ledger.capacity, ledger.used) == ([4, 4], [2, 2])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(capacity=[4, 4], used=[-1, 0]), "used"),
        (dict(capacity=[4, 4], used=[5, 0]), "used"),
        (dict(capacity=[4, 4], used=[0, 5]), "used"),
        (dict(capacity=[4, 4], used=[1]), "used"),
        (dict(capacity=[4, 4], used=[1, 1, 1]), "used"),
        (dict(capacity=[4, 4], used=[1, 0.5]), "used"),
        (dict(capacity=[4, 2.5]), "capacity"),
        (dict(capacity=[4, -1]), "capacity"),
        (dict(capacity=[]), "capacity"),
        (dict(capacity=4), "capacity"),
        (dict(capacity=None), "capacity"),
    ],
)
def test_ledger_constructor(kwargs, name):
    expect_named_error(name, HostSlotLedger, **kwargs)


def test_ledger_keeps_its_own_copies():
    capacity, used = [4, 4], [1, 2]
    ledger = HostSlotLedger(capacity, used)
    ledger.charge([1, 1])
    assert (capacity, used) == ([4, 4], [1, 2]) and ledger.used == [2, 3]
    assert HostSlotLedger([3, 5]).used == [0, 0]
    assert HostSlotLedger((3, 5), (3, 5)).free_slots() == [0, 0]  # full is allowed


# ---- placement sizes -------------------------------------------------------------

@given(
    value=st.one_of(st.floats(allow_nan=True), st.booleans(), st.integers(-100, -1), st.none(),
                    st.just(torch.tensor(2)), st.just("2")),
    method=st.sampled_from(["owned_pages", "physical_size"]),
)
def test_layout_sizes_take_non_negative_ints(value, method):
    placement = CpPlacement(4, 2, 0)
    name = "logical_num_pages" if method == "owned_pages" else "logical_size"
    expect_named_error(name, getattr(placement, method), value)


def test_owned_pages_of_a_fraction_raises():
    expect_named_error("logical_num_pages", CpPlacement(64, 2, 0).owned_pages, 2.5)


# ---- metadata: host slots, owners and owned positions agree ----------------------

P4 = CpPlacement(4, 2, 1)  # page_size 4, 2 ranks, rank 1
OWNERS = [0] * 4 + [1] * 4 + [1] * 4  # three pages: rank 0, 1, 1


def owned_meta(positions, hosts, owners=OWNERS, placement=P4):
    return CpHiCacheNodeMetadata(
        len(owners), torch.tensor(positions, dtype=torch.int64), torch.tensor(hosts, dtype=torch.int64),
        torch.tensor(owners), placement=placement,
    )


def test_consistent_metadata_with_a_layout_is_accepted():
    m = owned_meta(list(range(4, 12)), list(range(20, 28)))
    assert m.owner_slot_counts(2) == [4, 8] and m.num_host_slots == 8
    zero = owned_meta([], [], owners=[0] * 8)  # a rank owning none of the node
    assert zero.num_host_slots == 0


@pytest.mark.parametrize(
    "positions, hosts, owners, name",
    [
        ([4, 5], [7, 7], None, "host_indices"),  # one slot for two tokens
        (list(range(4, 12)), [20, 21, 22, 23, 24, 25, 26, 20], OWNERS, "host_indices"),
        (list(range(4, 8)), list(range(4)), OWNERS, "owned_positions"),  # misses a page
        (list(range(0, 8)), list(range(8)), OWNERS, "owned_positions"),  # rank 0's page
        (list(range(4, 12)), list(range(8)), [0] * 3 + [1] * 9, "token_owners"),  # owner changes mid-page
        (list(range(4, 12)), list(range(8)), [0] * 4 + [1] * 4 + [2] * 4, "token_owners"),  # rank 2 of 2
    ],
)
def test_inconsistent_metadata_raises(positions, hosts, owners, name):
    if owners is None:
        expect_named_error(name, CpHiCacheNodeMetadata, 8, torch.tensor(positions), torch.tensor(hosts))
    else:
        expect_named_error(name, owned_meta, positions, hosts, owners)


def test_metadata_placement_must_be_a_placement():
    expect_named_error("placement", owned_meta, list(range(4, 12)), list(range(8)), OWNERS, (4, 2, 1))


@given(
    cp_size=st.integers(1, 4),
    page_size=st.sampled_from([1, 2, 4]),
    page_owners=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    rank=st.integers(0, 3),
    flip=st.integers(0, 10_000),
)
def test_metadata_owner_cross_checks(cp_size, page_size, page_owners, rank, flip):
    """Metadata as a write plan builds it passes the placement checks; giving one
    token to or taking it from this rank, naming a rank past the last, or
    dropping one owned position never does."""
    placement = CpPlacement(page_size, cp_size, rank % cp_size)
    owners = torch.tensor([o % cp_size for o in page_owners]).repeat_interleave(page_size)
    mine = torch.nonzero(owners == placement.cp_rank).reshape(-1)
    hosts = torch.arange(100, 100 + mine.numel())
    CpHiCacheNodeMetadata(owners.numel(), mine, hosts, owners, placement=placement)
    # One token moves to or away from this rank.
    bad = owners.clone()
    i = flip % bad.numel()
    bad[i] = (placement.cp_rank + 1) % (cp_size + 1) if int(bad[i]) == placement.cp_rank else placement.cp_rank
    # With one-token pages the owners stay page-constant; the owned positions differ.
    name = "token_owners" if page_size > 1 or int(bad[i]) == cp_size else "owned_positions"
    expect_named_error(name, CpHiCacheNodeMetadata, owners.numel(), mine, hosts, bad, placement=placement)
    past = owners.clone()
    past[i] = cp_size  # one past the last rank
    expect_named_error("token_owners", CpHiCacheNodeMetadata, owners.numel(), mine, hosts, past, placement=placement)
    if mine.numel():
        j = flip % mine.numel()
        keep = torch.cat([mine[:j], mine[j + 1:]])
        expect_named_error("owned_positions", CpHiCacheNodeMetadata, owners.numel(), keep,
                           hosts[:-1], owners, placement=placement)


@pytest.mark.parametrize("cp_size", [1, 0, -1, True, 2.0, None])
def test_owner_slot_counts_has_one_entry_per_rank(cp_size):
    m = CpHiCacheNodeMetadata(8, torch.tensor([4, 5]), torch.tensor([0, 1]), torch.tensor([0] * 4 + [1] * 4))
    expect_named_error("cp_size", m.owner_slot_counts, cp_size)
    assert m.owner_slot_counts(2) == [4, 4] and m.owner_slot_counts(3) == [4, 4, 0]


# ---- host eviction: required and cp_rank ------------------------------------------

def host_leaves():
    """Two evicted, backed-up leaves of 4 tokens under a root, rank 0's view:
    each leaf's first page (2 tokens) is rank 0's, its second rank 1's."""
    root = Node(key=(), value=torch.empty(0))
    leaves = []
    for k in (1, 2):
        leaf = attach(root, Node(key=(k, 0, 0, 0), last_access=k))
        set_host_state(leaf, CpHiCacheNodeMetadata(
            4, torch.tensor([0, 1]), torch.tensor([2 * k, 2 * k + 1]), torch.tensor([0, 0, 1, 1])))
        leaves.append(leaf)
    index = HostLeafIndex(lambda n: n.last_access)
    for leaf in leaves:
        index.refresh(leaf)
    return root, leaves, index, HostSlotLedger([8, 8], [4, 4])


def eviction_state(root, leaves, index, ledger):
    return (sorted(root.children), [(n.host_len, n.cp_hicache is not None) for n in leaves],
            sorted(n.key[0] for n in index), list(ledger.used))


@pytest.mark.parametrize(
    "required, cp_rank, use_ledger, name",
    [
        (True, 0, False, "required"),
        (False, 0, True, "required"),
        ([True, 0], 0, False, "required"),
        (-1, 0, False, "required"),
        ([1, -1], 0, False, "required"),
        ([], 0, False, "required"),
        ([1.0, 0], 0, False, "required"),
        (2.0, 0, False, "required"),
        ("11", 0, False, "required"),
        (None, 0, False, "required"),
        ([1, 0], 2, False, "cp_rank"),
        ([1, 0], -1, False, "cp_rank"),
        (1, -1, False, "cp_rank"),
        (1, 2, True, "cp_rank"),
        (1, True, True, "cp_rank"),
        (1, 0.0, True, "cp_rank"),
        ([1, 0, 0], 0, True, "required"),  # three ranks, a ledger of two
    ],
)
def test_evict_host_slots_arguments(required, cp_rank, use_ledger, name):
    root, leaves, index, ledger = host_leaves()
    before = eviction_state(root, leaves, index, ledger)
    freed = []
    expect_named_error(name, evict_host_slots, index, required, cp_rank=cp_rank, child_key=child_key,
                       free_host=freed.append, ledger=ledger if use_ledger else None)
    assert freed == [] and eviction_state(root, leaves, index, ledger) == before


def test_evict_host_slots_ledger_must_be_a_ledger():
    root, leaves, index, ledger = host_leaves()
    before = eviction_state(root, leaves, index, ledger)
    expect_named_error("ledger", evict_host_slots, index, 1, cp_rank=0, child_key=child_key,
                       free_host=lambda i: None, ledger=[8, 8])
    assert eviction_state(root, leaves, index, ledger) == before


def test_scalar_required_with_a_ledger_releases_every_ranks_share():
    root, leaves, index, ledger = host_leaves()
    result = evict_host_slots(index, 1, cp_rank=0, child_key=child_key, free_host=lambda i: None,
                              ledger=ledger)
    assert result.nodes_evicted == 1 and ledger.used == [2, 2]


def test_eviction_refuses_metadata_that_disagrees_with_its_owners():
    root, leaves, index, ledger = host_leaves()
    # Rank 0 claims three slots where token_owners give it two.
    leaves[0].cp_hicache = CpHiCacheNodeMetadata._trusted(
        4, torch.tensor([0, 1, 2]), torch.tensor([2, 3, 9]), torch.tensor([0, 0, 1, 1]))
    before = eviction_state(root, leaves, index, ledger)
    freed = []
    with pytest.raises(RuntimeError, match="token_owners"):
        evict_host_slots(index, [1, 0], cp_rank=0, child_key=child_key, free_host=freed.append,
                         ledger=ledger)
    assert freed == [] and eviction_state(root, leaves, index, ledger) == before


def test_eviction_refuses_to_release_more_than_the_ledger_holds():
    root, leaves, index, _ = host_leaves()
    ledger = HostSlotLedger([8, 8], [2, 1])  # rank 1 holds 1 slot, the leaf frees 2
    before = eviction_state(root, leaves, index, ledger)
    with pytest.raises(RuntimeError, match="ledger"):
        evict_host_slots(index, [1, 0], cp_rank=0, child_key=child_key, free_host=lambda i: None,
                         ledger=ledger)
    assert eviction_state(root, leaves, index, ledger) == before


# ---- load-back arguments ------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(load_back_threshold=-1), "load_back_threshold"),
        (dict(load_back_threshold=1.5), "load_back_threshold"),
        (dict(load_back_threshold=None), "load_back_threshold"),
        (dict(mem_quota=2.0), "mem_quota"),
        (dict(mem_quota=True), "mem_quota"),
    ],
)
def test_cp_load_back_arguments(kwargs, name):
    root, leaves, index, ledger = host_leaves()
    calls = []
    args = dict(load_back_threshold=1, mem_quota=None, inc_lock_ref=lambda n: calls.append("inc") or 0,
                dec_lock_ref=lambda n: calls.append("dec"), load=lambda c: calls.append("load"),
                evict_device=lambda n: calls.append("evict"))
    args.update(kwargs)
    expect_named_error(name, cp_load_back, leaves[0], **args)
    assert calls == [] and leaves[0].value is None
