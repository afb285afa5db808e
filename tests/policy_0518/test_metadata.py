"""Metadata construction and validation, plus properties of split."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.policy_0518.metadata import CpHiCacheNodeMetadata


def meta(logical_len, positions, hosts, owners=None):
    return CpHiCacheNodeMetadata(
        logical_len=logical_len,
        owned_positions=torch.tensor(positions, dtype=torch.int64),
        host_indices=torch.tensor(hosts, dtype=torch.int64),
        token_owners=None if owners is None else torch.tensor(owners),
    )


def test_split_zero_len_moves_all_positions_to_child():
    parent, child = meta(8, [1, 3, 7], [10, 11, 12]).split(0)
    assert (parent.logical_len, parent.owned_positions.tolist(), parent.host_indices.tolist()) == (0, [], [])
    assert child.logical_len == 8
    assert child.owned_positions.tolist() == [1, 3, 7]
    assert child.host_indices.tolist() == [10, 11, 12]


def test_split_full_len_keeps_all_in_parent():
    parent, child = meta(8, [1, 3, 7], [10, 11, 12]).split(8)
    assert parent.owned_positions.tolist() == [1, 3, 7] and child.logical_len == 0
    assert child.owned_positions.numel() == 0 and child.host_indices.numel() == 0


def test_split_rebases_child_positions():
    parent, child = meta(10, [0, 2, 5, 9], [20, 21, 22, 23]).split(5)
    assert parent.logical_len == 5
    assert parent.owned_positions.tolist() == [0, 2]
    assert parent.host_indices.tolist() == [20, 21]
    assert child.logical_len == 5
    assert child.owned_positions.tolist() == [0, 4]
    assert child.host_indices.tolist() == [22, 23]


def test_split_carries_token_owners():
    parent, child = meta(4, [1, 2], [5, 6], owners=[0, 1, 1, 0]).split(2)
    assert parent.token_owners.tolist() == [0, 1] and child.token_owners.tolist() == [1, 0]
    assert child.owner_slot_counts(2) == [1, 1]


def test_zero_owned_metadata_is_valid_and_cpu_int64():
    m = CpHiCacheNodeMetadata(64, torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int16))
    assert m.logical_len == 64 and m.num_host_slots == 0
    for t in (m.owned_positions, m.host_indices):
        assert t.device.type == "cpu" and t.dtype == torch.int64


def test_converts_any_int_dtype():
    m = CpHiCacheNodeMetadata(4, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.uint8))
    assert m.owned_positions.dtype == torch.int64 and m.host_indices.tolist() == [3, 4]


def test_invalid_split_raises():
    m = meta(4, [1], [9])
    with pytest.raises(ValueError, match="split_len"):
        m.split(5)
    with pytest.raises(ValueError, match="split_len"):
        m.split(-1)


@pytest.mark.parametrize(
    "args, word",
    [
        ((4, [2, 1], [9, 10]), "sorted"),
        ((4, [1, 1], [9, 10]), "sorted"),  # a duplicate position is invalid
        ((4, [1, 2], [9]), "same length"),
        ((4, [4], [9]), r"\[0, logical_len\)"),
        ((4, [-1], [9]), r"\[0, logical_len\)"),
        ((-1, [], []), "logical_len"),
        ((4, [1], [-3]), "non-negative"),
    ],
)
def test_invalid_metadata_raises(args, word):
    with pytest.raises(ValueError, match=word):
        meta(*args)


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match="owned_positions"):
        CpHiCacheNodeMetadata(4, torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(TypeError, match="host_indices"):
        CpHiCacheNodeMetadata(4, torch.tensor([1]), [1])
    with pytest.raises(TypeError, match="logical_len"):
        CpHiCacheNodeMetadata(4.0, torch.tensor([1]), torch.tensor([1]))


@st.composite
def metadata_and_cuts(draw):
    n = draw(st.integers(0, 60))
    owned = sorted(draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n))) if n else []
    hosts = draw(st.permutations(list(range(100, 100 + len(owned)))))
    cuts = draw(st.lists(st.integers(0, n), max_size=4))
    return meta(n, owned, hosts), cuts


@given(metadata_and_cuts())
def test_split_partitions_in_order_and_chains_agree(data):
    m, cuts = data
    # Split the chain piece by piece at the cut points (in order of position).
    points = sorted(set(cuts))
    pieces, rest, base = [], m, 0
    for p in points:
        left, rest = rest.split(p - base)
        pieces.append(left)
        base = p
    pieces.append(rest)
    assert sum(x.logical_len for x in pieces) == m.logical_len
    assert torch.equal(torch.cat([x.host_indices for x in pieces]), m.host_indices)
    # Reassembled positions equal the original (undo the rebasing).
    offsets, acc = [], 0
    for x in pieces:
        offsets.append(acc)
        acc += x.logical_len
    rebuilt = torch.cat([x.owned_positions + o for x, o in zip(pieces, offsets)])
    assert torch.equal(rebuilt, m.owned_positions)
    # Any piece equals the direct split of the original at its bounds.
    for x, o in zip(pieces, offsets):
        _, tail = m.split(o)
        direct, _ = tail.split(x.logical_len)
        assert torch.equal(direct.owned_positions, x.owned_positions)
        assert torch.equal(direct.host_indices, x.host_indices)
        CpHiCacheNodeMetadata(x.logical_len, x.owned_positions, x.host_indices)  # still valid
