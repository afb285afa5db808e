"""The CP cache refuses a tree page size other than its allocator's: the
tree would cut keys into pages the allocator does not place."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack


def test_a_page_size_other_than_the_allocators_is_refused_naming_it(monkeypatch):
    from sglang_cp_hicache.sglang_0518 import hiradix

    real = hiradix.CpHiRadixCache

    def with_half_pages(params, server_args):
        return real(dataclasses.replace(params, page_size=params.page_size // 2), server_args)

    monkeypatch.setattr(hiradix, "CpHiRadixCache", with_half_pages)
    with pytest.raises(ValueError, match=r"params\.page_size \(32\) must equal the CP allocator's page size \(64\)"):
        build_cp_rank_stack(CpStackConfig(cp_size=2), 0)
