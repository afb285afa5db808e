"""Start-up agreement of the CP cache: one all-gather of each rank's view
over the CP group when the cache is built (no all-reduce); each kind of
mismatch is refused on every rank, naming the disagreeing rank and value;
a bad environment value stops start-up."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from sglang_cp_hicache import settings
from sglang_cp_hicache.agreement import CpAgreementError
from sglang_cp_hicache.kernels.transfer import select_backend
from sglang_cp_hicache.sglang_0518 import hiradix
from sglang_cp_hicache.sglang_0518.checks import HOST_BALANCE_ENV
from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack
from tests.helpers.cp_cluster import RankSetup, build_each_rank, building_rank

P = 64
CONFIG = CpStackConfig(cp_size=2, device_pages=3, host_pages=8)


def refused_everywhere(outcomes: list) -> set[str]:
    """Every rank raised CpAgreementError; their messages."""
    assert [type(o) for o in outcomes] == [CpAgreementError] * len(outcomes), outcomes
    return {str(o) for o in outcomes}


def test_agreeing_ranks_start_after_one_all_gather_and_no_all_reduce(monkeypatch):
    calls = {"all_gather_object": 0, "all_reduce": 0}
    views = {}
    for name in calls:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    gather = hiradix.gather_and_check

    def recorded(view, group):
        views[view.cp_rank] = view
        return gather(view, group)

    monkeypatch.setattr(hiradix, "gather_and_check", recorded)
    outcomes = build_each_rank(CONFIG, lambda r: RankSetup(r))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert calls == {"all_gather_object": 2, "all_reduce": 0}  # one per rank
    capacity = outcomes[0].cache.token_to_kv_pool_host.size
    assert capacity == CONFIG.host_pages * P
    expected = {
        "page_size": P,
        "host_layout": CONFIG.host_layout,
        "host_pool_slots": capacity,
        HOST_BALANCE_ENV: "exact",
        "copy_backend": select_backend("cpu"),
        "copy_path": "library",
        "l3": "off",
    }
    assert {r: (v.cp_size, v.values) for r, v in views.items()} == {0: (2, expected), 1: (2, expected)}


def _lie_about_page_size(monkeypatch, rank: int, page_size: int) -> None:
    """Rank ``rank`` presents another page size (DSA pools only take 64, so
    no stack can really be built with one)."""
    agree = CpHiRadixCache._agree_with_peers

    def lying(self, l3_view):
        if building_rank() == rank:
            self.page_size = page_size
        return agree(self, l3_view)

    monkeypatch.setattr(CpHiRadixCache, "_agree_with_peers", lying)


MISMATCHES = {
    "cp_size": (
        lambda r: RankSetup(r, {"cp_size": 4} if r == 1 else {}),
        "CP ranks disagree on cp_size: group rank 1 (cp_rank 1) has 4, group rank 0 (cp_rank 0) has 2",
    ),
    "host_layout": (
        lambda r: RankSetup(r, {"host_layout": "page_first"} if r == 1 else {}),
        "CP ranks disagree on host_layout: cp_rank 1 has 'page_first', cp_rank 0 has 'layer_first'; "
        "start every rank with the same host_layout",
    ),
    "duplicate_cp_rank": (
        lambda r: RankSetup(0),
        "cp_rank 0 is claimed by group ranks 0 and 1; each rank of the CP group needs its own cp_rank in 0..1",
    ),
    "page_size": (
        lambda r: RankSetup(r),
        "CP ranks disagree on page_size: cp_rank 1 has 128, cp_rank 0 has 64; start every rank with the "
        "same page_size",
    ),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_mismatch_is_refused_on_every_rank_naming_rank_and_value(case, monkeypatch):
    per_rank, expected = MISMATCHES[case]
    if case == "page_size":
        _lie_about_page_size(monkeypatch, rank=1, page_size=128)
    assert refused_everywhere(build_each_rank(CONFIG, per_rank)) == {expected}


def test_three_real_ranks_name_the_one_that_differs(monkeypatch):
    """Three ranks on a real gloo group; the last one runs another copy
    backend (a machine without the interpreter setting, say)."""
    monkeypatch.setattr(
        hiradix.transfer, "select_backend", lambda device: "triton" if building_rank() == 2 else "reference"
    )
    outcomes = build_each_rank(CpStackConfig(cp_size=3, device_pages=3, host_pages=8), lambda r: RankSetup(r))
    assert refused_everywhere(outcomes) == {
        "CP ranks disagree on copy_backend: cp_rank 2 has 'triton', cp_rank 0 has 'reference'; "
        "start every rank with the same copy_backend"
    }


def test_the_agreement_runs_over_the_cp_group_only(monkeypatch):
    """SGLang's ``_all_reduce`` also reduces over the attention-TP group,
    whose ranks share a cp_rank: the agreement uses ``attn_cp_group``, whose
    members are exactly the CP ranks; a group of one (ranks simulated in one
    process) checks only the rank itself."""
    cp_group, lone = object(), object()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: {id(cp_group): 4, id(lone): 1}[id(group)])
    cache = types.SimpleNamespace(attn_cp_group=cp_group, tp_group=object(), attn_tp_group=object())
    assert CpHiRadixCache._cp_group(cache) is cp_group
    cache.attn_cp_group = lone
    assert CpHiRadixCache._cp_group(cache) is None
    cache.attn_cp_group = None
    assert CpHiRadixCache._cp_group(cache) is None


@pytest.mark.parametrize("setting", [settings.DEBUG, settings.COPY, settings.HOST_BALANCE], ids=lambda s: s.name)
def test_a_bad_environment_value_stops_start_up(setting, monkeypatch):
    monkeypatch.setenv(setting.name, "libary")
    with pytest.raises(ValueError, match=f"{setting.name}='libary' is not valid"):
        build_cp_rank_stack(CpStackConfig(cp_size=2, device_pages=3, host_pages=8), 0)


def test_a_lone_rank_checks_its_own_view(monkeypatch):
    """Without a CP group of more than one rank, a view that contradicts
    itself (cp_rank outside cp_size) is still refused."""
    agree = CpHiRadixCache._agree_with_peers

    def out_of_range(self, l3_view):
        self.cp_placement = types.SimpleNamespace(cp_rank=5, cp_size=2)
        return agree(self, l3_view)

    monkeypatch.setattr(CpHiRadixCache, "_agree_with_peers", out_of_range)
    with pytest.raises(CpAgreementError, match=r"group rank 0 has cp_rank 5, outside 0..1"):
        build_cp_rank_stack(CONFIG, 0)
