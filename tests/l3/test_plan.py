"""Write and read plans: each rank exactly its own pages; the ranks' plans
are disjoint and cover the chain once."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.plan import L3ReadPlan, L3WritePlan, interleaved_owners, read_plan, write_plan
from sglang_cp_hicache.placement import page_owner
from tests.l3.common import hash_chain, namespace

KEYS = page_keys(hash_chain(6), namespace())


def test_small_example_rotation_phase():
    owners = interleaved_owners(first_page=5, num_pages=6, cp_size=4)
    assert owners == [1, 2, 3, 0, 1, 2]
    plans = [write_plan(KEYS, owners, 4, r) for r in range(4)]
    assert [p.page_indices for p in plans] == [(3,), (0, 4), (1, 5), (2,)]
    assert plans[1].keys == (KEYS[0], KEYS[4])
    assert all(p.num_pages == 6 and p.cp_rank == r for r, p in enumerate(plans))
    rp = read_plan(KEYS, owners, 4, 2)
    assert isinstance(rp, L3ReadPlan) and rp.page_indices == (1, 5) and rp.keys == (KEYS[1], KEYS[5])


@st.composite
def chains(draw):
    cp_size = draw(st.integers(1, 8))
    num_pages = draw(st.integers(0, 20))
    owners = draw(st.lists(st.integers(0, cp_size - 1), min_size=num_pages, max_size=num_pages))
    return cp_size, page_keys(hash_chain(num_pages, draw(st.integers(0, 99))), namespace()), owners


@given(chains())
def test_plans_are_disjoint_cover_once_and_match_each_rank(chain):
    cp_size, keys, owners = chain
    plans = [write_plan(keys, owners, cp_size, r) for r in range(cp_size)]
    assert len(plans) == cp_size
    covered = sorted(i for p in plans for i in p.page_indices)
    assert covered == list(range(len(keys)))
    for rank, plan in enumerate(plans):
        assert all(owners[i] == rank for i in plan.page_indices)
        assert plan.keys == tuple(keys[i] for i in plan.page_indices)
        rp = read_plan(keys, owners, cp_size, rank)
        assert (rp.page_indices, rp.keys, rp.num_pages) == (plan.page_indices, plan.keys, plan.num_pages)


@given(first=st.integers(0, 200), n=st.integers(0, 30), cp_size=st.integers(1, 8))
def test_interleaved_owners_is_the_placement_rule(first, n, cp_size):
    assert interleaved_owners(first, n, cp_size) == [page_owner(first + i, cp_size) for i in range(n)]
    assert interleaved_owners(first, n, cp_size) == [(first + i) % cp_size for i in range(n)]


@pytest.mark.parametrize(
    "args, word, kind",
    [
        ((KEYS, [0] * 5, 2), "owners", ValueError),
        ((KEYS, [0, 1, 2, 0, 1, 0], 2), r"owners\[2\]", ValueError),
        ((KEYS, [0, -1, 0, 0, 0, 0], 2), r"owners\[1\]", ValueError),
        ((KEYS, [0, 1.0, 0, 0, 0, 0], 2), r"owners\[1\]", TypeError),
        ((KEYS, [0] * 6, 0), "cp_size", ValueError),
        ((KEYS[0], [0], 1), "keys", TypeError),
        ((KEYS[:2] + ["x"], [0, 0, 0], 1), r"keys\[2\]", ValueError),
        ((KEYS[:2] + KEYS[:1], [0, 0, 0], 1), r"keys\[2\] repeats keys\[0\]", ValueError),
    ],
)
def test_bad_chains_name_the_argument(args, word, kind):
    with pytest.raises(kind, match=word):
        write_plan(*args, 0)
    with pytest.raises(kind, match=word):
        read_plan(*args, 0)


def test_bad_rank_and_bad_plans():
    with pytest.raises(ValueError, match="cp_rank"):
        write_plan(KEYS, [0] * 6, 2, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        read_plan(KEYS, [0] * 6, 2, -1)
    with pytest.raises(ValueError, match="first_page"):
        interleaved_owners(-1, 3, 2)
    with pytest.raises(ValueError, match=r"page_indices\[1\]"):
        L3WritePlan(0, 4, (2, 2), (KEYS[0], KEYS[1]))
    with pytest.raises(ValueError, match=r"page_indices\[0\]"):
        L3ReadPlan(0, 2, (2,), (KEYS[0],))
    with pytest.raises(ValueError, match="one entry per page"):
        L3ReadPlan(0, 2, (0,), ())
