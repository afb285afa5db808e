"""Prefetch consensus: the MIN over ranks of each rank's local usable prefix
is exactly the first page that failed on its owner."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.l3.consensus import local_usable_pages


def test_small_example():
    # 6 pages, owners 0 1 0 1 0 1; page 3 (rank 1) and page 4 (rank 0) missing.
    assert local_usable_pages([0, 2, 4], [True, True, False], 6) == 4
    assert local_usable_pages([1, 3, 5], [True, False, True], 6) == 3
    assert min(4, 3) == 3  # the group agrees on the MIN (SGLang's prefetch all-reduce)
    assert local_usable_pages([], [], 6) == 6  # a rank owning nothing never limits
    assert local_usable_pages([], [], 0) == 0


@st.composite
def prefetches(draw):
    cp_size = draw(st.integers(1, 8))
    num_pages = draw(st.integers(0, 40))
    owners = draw(st.lists(st.integers(0, cp_size - 1), min_size=num_pages, max_size=num_pages))
    missing = draw(st.sets(st.integers(0, max(num_pages - 1, 0)), max_size=num_pages)) if num_pages else set()
    return cp_size, owners, missing


@given(prefetches())
def test_min_of_local_values_is_the_first_page_missing_on_its_owner(case):
    cp_size, owners, missing = case
    num_pages = len(owners)
    local = []
    for rank in range(cp_size):
        owned = [i for i, o in enumerate(owners) if o == rank]
        value = local_usable_pages(owned, [i not in missing for i in owned], num_pages)
        # Nothing past this rank's first own miss is ever counted.
        assert all(i not in missing for i in owned if i < value)
        local.append(value)
    agreed = min(local)  # what the prefetch MIN all-reduce gives every rank
    assert agreed == min(missing, default=num_pages)
    assert all(i not in missing for i in range(agreed))


@given(prefetches())
def test_flags_after_the_first_own_miss_do_not_matter(case):
    cp_size, owners, missing = case
    for rank in range(cp_size):
        owned = [i for i, o in enumerate(owners) if o == rank]
        flags = [i not in missing for i in owned]
        if False in flags:
            cut = flags.index(False)
            flipped = flags[: cut + 1] + [not f for f in flags[cut + 1:]]
            assert local_usable_pages(owned, flipped, len(owners)) == local_usable_pages(owned, flags, len(owners))


@pytest.mark.parametrize(
    "args, word, kind",
    [
        (([0, 2], [True], 4), "ok_flags", ValueError),
        (([0, 2], [True, 1], 4), r"ok_flags\[1\]", TypeError),
        (([0, 2], "tt", 4), "ok_flags", TypeError),
        (([2, 0], [True, True], 4), r"owned_page_indices\[1\]", ValueError),
        (([1, 1], [True, True], 4), r"owned_page_indices\[1\]", ValueError),
        (([0, 4], [True, True], 4), r"owned_page_indices\[1\]", ValueError),
        (([-1], [True], 4), r"owned_page_indices\[0\]", ValueError),
        (([0], [True], -1), "num_pages", ValueError),
    ],
)
def test_bad_local_input_names_the_argument(args, word, kind):
    with pytest.raises(kind, match=word):
        local_usable_pages(*args)
