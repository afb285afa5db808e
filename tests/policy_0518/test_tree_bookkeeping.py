"""Seed Tasks 5, 6, 8 against the minimal node protocol."""

import pytest
import torch

from sglang_cp_hicache.policy_0518.host_eviction import HostLeafIndex, HostSlotLedger, evict_host_slots, is_host_leaf
from sglang_cp_hicache.policy_0518.load_back import cp_load_back
from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.policy_0518.node_state import clear_host_state, is_backed_up, set_host_state, split_host_state
from sglang_cp_hicache.testing.tree_nodes import Node, attach, child_key


def meta(n, pos, hosts, owners=None):
    return CpHiCacheNodeMetadata(
        n, torch.tensor(pos, dtype=torch.int64), torch.tensor(hosts, dtype=torch.int64),
        None if owners is None else torch.tensor(owners),
    )


def test_backed_up_uses_cp_metadata_not_host_value():
    node = Node(key=(1,))
    assert not is_backed_up(node)
    set_host_state(node, meta(8, [1, 2], [10, 11]))
    assert is_backed_up(node) and node.host_len == 8
    zero = Node(key=(2,))
    set_host_state(zero, meta(4, [], []))  # a rank owning nothing is backed up too
    assert is_backed_up(zero)


def test_split_node_splits_cp_metadata_by_owned_positions():
    child = Node(key=tuple(range(10)), host_len=10, cp_hicache=meta(10, [0, 2, 5, 9], [20, 21, 22, 23]))
    new_node = Node(key=tuple(range(5)))
    split_host_state(child, new_node, 5)
    assert new_node.host_len == 5 and child.host_len == 5
    assert new_node.cp_hicache.owned_positions.tolist() == [0, 2]
    assert new_node.cp_hicache.host_indices.tolist() == [20, 21]
    assert child.cp_hicache.owned_positions.tolist() == [0, 4]
    assert child.cp_hicache.host_indices.tolist() == [22, 23]


def test_split_of_unbacked_node_leaves_both_unbacked():
    child, new_node = Node(key=(1, 2)), Node(key=(1,))
    split_host_state(child, new_node, 1)
    assert new_node.cp_hicache is None and new_node.host_len == 0 and child.host_len == 0


def test_clear_host_state_returns_physical_and_logical_counts():
    freed = []
    node = Node(key=(1,), host_len=16, cp_hicache=meta(16, [4, 5], [7, 8]))
    result = clear_host_state(node, freed.append)
    assert (result.physical_slots, result.logical_tokens) == (2, 16)
    assert freed[0].tolist() == [7, 8] and node.cp_hicache is None and node.host_len == 0
    zero = Node(key=(2,), host_len=4, cp_hicache=meta(4, [], []))
    assert clear_host_state(zero, freed.append).physical_slots == 0 and len(freed) == 1


def build_chain(*metas):
    """root -> n1 -> n2 ...; every node evicted from device and backed up."""
    root = Node(key=(), value=torch.empty(0, dtype=torch.int64))
    nodes, parent = [], root
    for i, m in enumerate(metas):
        n = attach(parent, Node(key=(i + 1,) + tuple(range(m.logical_len - 1)), last_access=i))
        set_host_state(n, m)
        nodes.append(n)
        parent = n
    return root, nodes


def test_cp_host_eviction_uses_physical_freed_slots_for_progress():
    root, (node,) = build_chain(meta(4, [1], [70]))
    index = HostLeafIndex(lambda n: n.last_access)
    index.refresh(node)
    freed = []
    result = evict_host_slots(index, 1, cp_rank=0, child_key=child_key, free_host=freed.append)
    assert result.physical_slots_freed == 1 and result.logical_tokens_freed == 4
    assert freed[0].tolist() == [70]
    assert node.host_len == 0 and node.cp_hicache is None
    assert root.children == {}


def test_host_eviction_cascades_to_parents_and_skips_locked():
    root, (a, b) = build_chain(meta(4, [0, 1], [1, 2]), meta(4, [3], [3]))
    other = attach(root, Node(key=(9, 9, 9, 9), last_access=-5))
    set_host_state(other, meta(4, [0], [4]))
    other.host_ref_counter = 1  # protected: must be skipped, and stay indexed
    index = HostLeafIndex(lambda n: n.last_access)
    for n in (a, b, other):
        index.refresh(n)
    assert a not in index and b in index and other in index  # a has a child
    freed = []
    result = evict_host_slots(index, 3, cp_rank=0, child_key=child_key, free_host=freed.append)
    assert result.physical_slots_freed == 3 and result.nodes_evicted == 2
    assert [f.tolist() for f in freed] == [[3], [1, 2]]  # leaf first, then parent
    assert list(root.children.values()) == [other] and other in index and len(index) == 1


def test_host_eviction_stops_when_nothing_left():
    root, (a,) = build_chain(meta(4, [0], [1]))
    index = HostLeafIndex(lambda n: n.last_access)
    index.refresh(a)
    result = evict_host_slots(index, 10, cp_rank=0, child_key=child_key, free_host=lambda i: None)
    assert result.physical_slots_freed == 1 and len(index) == 0


def test_per_rank_eviction_makes_every_rank_evict_the_same_nodes():
    # Two host leaves; rank 0 owns nothing in the first, rank 1 owns it all.
    owners_a, owners_b = [1, 1, 1, 1], [0, 0, 1, 1]
    evicted_keys = []
    for rank in (0, 1):
        root = Node(key=(), value=torch.empty(0))
        metas = []
        for owners in (owners_a, owners_b):
            pos = [i for i, o in enumerate(owners) if o == rank]
            metas.append(meta(4, pos, list(range(10, 10 + len(pos))), owners))
        na = attach(root, Node(key=(1, 0, 0, 0), last_access=0))
        nb = attach(root, Node(key=(2, 0, 0, 0), last_access=1))
        set_host_state(na, metas[0])
        set_host_state(nb, metas[1])
        ledger = HostSlotLedger(capacity=[8, 8], used=[2, 6])
        index = HostLeafIndex(lambda n: n.last_access)
        index.refresh(na)
        index.refresh(nb)
        # Rank 0 is short by 1 slot, rank 1 by 0: every rank must evict until rank 0 got 1.
        result = evict_host_slots(
            index, [1, 0], cp_rank=rank, child_key=child_key, free_host=lambda i: None, ledger=ledger
        )
        evicted_keys.append(sorted(k for k in (1, 2) if k not in root.children))
        assert result.slots_freed_per_rank == (2, 6)
        assert ledger.used == [0, 0]
    assert evicted_keys[0] == evicted_keys[1] == [1, 2]


def test_leaf_index_orders_by_priority_and_follows_updates():
    nodes = [Node(key=(i,), last_access=i) for i in range(5)]
    root = Node(key=(), value=torch.empty(0))
    for n in nodes:
        attach(root, n)
        set_host_state(n, meta(1, [], []))
    index = HostLeafIndex(lambda n: n.last_access)
    for n in reversed(nodes):
        index.refresh(n)
    nodes[0].last_access = 10  # touched: now the most recent
    index.discard(nodes[3])
    order = []
    while (n := index.pop()) is not None:
        order.append(n.key[0])
    assert order == [1, 2, 4, 0]


def test_ledger_rejects_overcharge():
    ledger = HostSlotLedger([4, 4])
    ledger.charge([4, 0])
    assert ledger.shortfall([1, 4]) == [1, 0] and not ledger.fits([1, 0])
    with pytest.raises(ValueError, match="exceeds"):
        ledger.charge([1, 0])
    with pytest.raises(ValueError, match="exceeds"):
        ledger.release([0, 1])


# ---- load-back ----------------------------------------------------------------

class Locks:
    def __init__(self, delta=0):
        self.delta, self.calls = delta, []

    def inc(self, node):
        self.calls.append(("inc", node.id))
        return self.delta

    def dec(self, node):
        self.calls.append(("dec", node.id))


def evicted_chain_on_root(*lens):
    root = Node(key=(), value=torch.empty(0, dtype=torch.int64))
    parent, nodes = root, []
    for i, n in enumerate(lens):
        node = attach(parent, Node(key=(i + 1,) + (0,) * (n - 1)))
        set_host_state(node, meta(n, [0, 1] if n > 1 else [], [50, 51] if n > 1 else []))
        nodes.append(node)
        parent = node
    return root, nodes


def test_cp_load_back_uses_host_len_and_assigns_logical_slices():
    root, (a, b) = evicted_chain_on_root(8, 4)
    locks, loads = Locks(), []

    def load(chain):
        loads.append([n.id for n in chain])
        return torch.arange(32, 44)

    out = cp_load_back(b, load_back_threshold=1, mem_quota=None, inc_lock_ref=locks.inc,
                       dec_lock_ref=locks.dec, load=load, evict_device=lambda n: None)
    assert out.host_hit_len == 12 and loads == [[a.id, b.id]]
    assert a.value.tolist() == list(range(32, 40)) and b.value.tolist() == list(range(40, 44))
    assert locks.calls == [("inc", root.id), ("dec", root.id)]


def test_cp_load_back_threshold_and_quota_use_logical_length():
    root, (a,) = evicted_chain_on_root(6)  # rank owns 2 of 6 tokens
    kwargs = dict(inc_lock_ref=Locks().inc, dec_lock_ref=lambda n: None,
                  load=lambda c: torch.arange(10, 16), evict_device=lambda n: None)
    assert cp_load_back(a, load_back_threshold=7, mem_quota=None, **kwargs) is None
    assert a.value is None
    assert cp_load_back(a, load_back_threshold=5, mem_quota=5, **kwargs) is None  # 6 > 5
    out = cp_load_back(a, load_back_threshold=5, mem_quota=6, **kwargs)
    assert out.device_locs.tolist() == [10, 11, 12, 13, 14, 15]


def test_cp_load_back_retries_after_evicting_logical_length():
    root, (a,) = evicted_chain_on_root(8)
    evictions, attempts = [], []

    def load(chain):
        attempts.append(1)
        return None if len(attempts) == 1 else torch.arange(8)

    locks = Locks()
    out = cp_load_back(a, load_back_threshold=1, mem_quota=None, inc_lock_ref=locks.inc,
                       dec_lock_ref=locks.dec, load=load, evict_device=evictions.append)
    assert evictions == [8] and out.retried_after_eviction
    # Failure after the retry: None, lock released, value untouched.
    root, (b,) = evicted_chain_on_root(8)
    locks = Locks()
    assert cp_load_back(b, load_back_threshold=1, mem_quota=None, inc_lock_ref=locks.inc,
                        dec_lock_ref=locks.dec, load=lambda c: None, evict_device=lambda n: None) is None
    assert b.value is None and locks.calls[-1][0] == "dec"


def test_evicted_node_without_backup_is_an_error():
    root = Node(key=(), value=torch.empty(0))
    lost = attach(root, Node(key=(1,)))
    with pytest.raises(RuntimeError, match="no host backup"):
        cp_load_back(lost, load_back_threshold=1, mem_quota=None, inc_lock_ref=lambda n: 0,
                     dec_lock_ref=lambda n: None, load=lambda c: None, evict_device=lambda n: None)


def test_is_host_leaf():
    root, (a, b) = evicted_chain_on_root(2, 2)
    assert not is_host_leaf(root) and not is_host_leaf(a) and is_host_leaf(b)
    b.value = torch.arange(2)
    assert not is_host_leaf(b)
