import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache import CpPlacement
from sglang_cp_hicache.placement import page_owner, phase_owner


def test_formula_small_example():
    placement = CpPlacement(page_size=4, cp_size=4, cp_rank=1)
    locs = torch.arange(0, 32)
    assert placement.owner_of(locs).tolist() == [(l // 4) % 4 for l in range(32)]
    mask = placement.owned_by_this_rank(locs)
    assert locs[mask].tolist() == [4, 5, 6, 7, 20, 21, 22, 23]
    assert placement.logical_locs_to_physical(locs[mask]).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert placement.physical_locs_to_logical(torch.arange(8)).tolist() == [4, 5, 6, 7, 20, 21, 22, 23]


def test_owned_by_this_rank_returns_bool_on_input_device():
    placement = CpPlacement(16, 2, 0)
    mask = placement.owned_by_this_rank(torch.arange(64, dtype=torch.int32))
    assert mask.dtype == torch.bool and mask.device.type == "cpu"


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(page_size=0, cp_size=1, cp_rank=0), "page_size"),
        (dict(page_size=1, cp_size=0, cp_rank=0), "cp_size"),
        (dict(page_size=1, cp_size=2, cp_rank=2), "cp_rank"),
        (dict(page_size=1, cp_size=2, cp_rank=-1), "cp_rank"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        CpPlacement(**kwargs)


def test_bad_types():
    with pytest.raises(TypeError, match="page_size"):
        CpPlacement(1.0, 1, 0)
    with pytest.raises(TypeError, match="locs"):
        CpPlacement(1, 1, 0).owner_of(torch.zeros(3))
    with pytest.raises(ValueError, match="logical_size"):
        CpPlacement(4, 2, 0).physical_size(-1)


def test_physical_size_counts_owned_pages():
    # 10 pages over 4 ranks: ranks 0,1 own 3 pages, ranks 2,3 own 2.
    sizes = [CpPlacement(8, 4, r).physical_size(80) for r in range(4)]
    assert sizes == [24, 24, 16, 16]
    # A partial last page still needs a whole physical page on its owner.
    assert CpPlacement(8, 4, 1).physical_size(9) == 8
    assert CpPlacement(8, 4, 2).physical_size(9) == 0


@given(
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    cp_size=st.integers(1, 8),
    num_pages=st.integers(1, 40),
)
def test_round_trip_and_density(page_size, cp_size, num_pages):
    locs = torch.arange(num_pages * page_size)
    seen = torch.zeros_like(locs)
    for rank in range(cp_size):
        placement = CpPlacement(page_size, cp_size, rank)
        mine = locs[placement.owned_by_this_rank(locs)]
        phys = placement.logical_locs_to_physical(mine)
        # Dense: this rank's physical slots are exactly 0..len-1, in order.
        assert torch.equal(phys, torch.arange(mine.numel()))
        assert phys.numel() == placement.physical_size(locs.numel())
        assert torch.equal(placement.physical_locs_to_logical(phys), mine)
        seen[mine] += 1
    assert bool((seen == 1).all())  # every logical loc has exactly one owner


def test_phase_owner_is_the_cyclic_rule():
    # A run at phase 6 on 4 classes: its pages go to classes 2, 3, 0, 1, 2.
    assert [phase_owner(6, 4, page) for page in range(5)] == [2, 3, 0, 1, 2]
    assert phase_owner(6, 4) == 2  # the run's first page: the phase's own class
    assert phase_owner(0, 1, 7) == 0  # one rank owns everything


@given(phase=st.integers(0, 10_000), cp_size=st.integers(1, 16), page=st.integers(0, 1_000))
def test_phase_owner_matches_the_page_owner_of_the_phase_page(phase, cp_size, page):
    # Phases count pages: a run at phase p places its page i where the
    # interleave places logical page p + i.
    assert phase_owner(phase, cp_size, page) == page_owner(phase + page, cp_size) == (phase + page) % cp_size
    assert phase_owner(phase, cp_size, page) == phase_owner(phase_owner(phase, cp_size), cp_size, page)
