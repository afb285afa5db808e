"""The CP ranks' start-up agreement when the library stack is built: one
all-gather per build; any disagreement refused on every rank, naming the
rank and the value."""

from __future__ import annotations

import pickle
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_cp_hicache import settings
from sglang_cp_hicache.agreement import (
    COPY_BACKEND_KEY,
    COPY_PATH_KEY,
    HOST_POOL_SLOTS_KEY,
    L3_KEY,
    RankView,
    gather_and_check,
)
from sglang_cp_hicache.sglang_0523.startup import (
    COPY_PATH,
    HINTS,
    HOST_TAIL_KEY,
    SETTINGS_KEY,
    agree_at_start_up,
    start_up_view,
)

from tests.helpers.gloo_gather import agreement_on_threads, object_all_gather

# ---- real stacks, two rank processes (tests/helpers/sglang_0523/scenarios.py::agreement) -----

REFUSED = {
    "host_layout": "CP ranks disagree on host_layout: cp_rank 1 has 'page_first', cp_rank 0 has 'layer_first'; "
    "start every rank with the same host_layout",
    "host_pages": "CP ranks disagree on host_pool_slots: cp_rank 1 has 1344, cp_rank 0 has 1088; "
    "start every rank with the same host_pool_slots",
    "device_pages": "CP ranks disagree on device_pages: cp_rank 1 has 10, cp_rank 0 has 8; "
    "start every rank with the same device_pages",
    "kernel_backend": "CP ranks disagree on copy_backend: cp_rank 1 has 'reference', cp_rank 0 has "
    "'triton-interpret'; start every rank with the same copy_backend",
    "duplicate_rank": "cp_rank 0 is claimed by group ranks 0 and 1; each rank of the CP group needs its own "
    "cp_rank in 0..1",
    # a rank on SGLANG_CP_HICACHE_COPY=upstream among library ranks: refused on both, nobody waits
    "copy_path": "CP ranks disagree on copy_path: cp_rank 1 has 'upstream', "
    "cp_rank 0 has 'library'; start every rank with the same copy_path; SGLANG_CP_HICACHE_COPY sets the copy path",
    "settings": f"CP ranks disagree on {SETTINGS_KEY}: cp_rank 1 has \"SGLANG_CP_HICACHE_DEBUG='maybe' is not "
    "valid; use one of: 1, true, yes, on, 0, false, no, off (default 0)\", cp_rank 0 has 'valid'",
}


def test_agreeing_ranks_build_with_one_all_gather(two_ranks):
    assert [r["agreement"]["agree"] for r in two_ranks] == [("built", 1), ("built", 1)]
    # upstream's stack on every rank (the plugin on SGLANG_CP_HICACHE_COPY=upstream) joins it too
    assert [r["agreement"]["upstream_on_every_rank"] for r in two_ranks] == [("built", 1), ("built", 1)]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_disagreement_is_refused_on_every_rank_naming_rank_and_value(two_ranks, case):
    for rank, result in enumerate(two_ranks):
        outcome, gathers = result["agreement"][case]
        assert outcome.startswith("CpAgreementError: ") and REFUSED[case] in outcome, (rank, outcome)
        assert gathers == 1, rank  # each rank reached the one all-gather


def test_a_bad_setting_on_every_rank_is_raised_after_they_agree(two_ranks):
    for result in two_ranks:
        outcome, gathers = result["agreement"]["settings_on_every_rank"]
        assert outcome == "ValueError: SGLANG_CP_HICACHE_DEBUG='maybe' is not valid; use one of: " \
                          "1, true, yes, on, 0, false, no, off (default 0)"
        assert gathers == 1


# ---- views built from stand-in pools, three ranks as threads on a gloo group ---------


def _stand_ins(rank: int, group: Any, *, cp_size: int = 3, page_size: int = 64) -> tuple[Any, Any]:
    """(device pool, host pool group) with the attributes the view reads."""
    kvcache = SimpleNamespace(
        shard_spec=SimpleNamespace(page_size=page_size), shard_rank=rank, shard_size=cp_size,
        size=8 * page_size, device="cpu", shard_group=SimpleNamespace(cpu_group=group),
    )
    host = SimpleNamespace(size=17 * page_size, page_size=page_size)
    return kvcache, SimpleNamespace(layout="page_first", anchor_entry=SimpleNamespace(host_pool=host))


@pytest.fixture
def valid_settings(monkeypatch):
    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)


def test_the_view_holds_every_value_the_ranks_share(valid_settings):
    view = start_up_view(*_stand_ins(2, None))
    assert (view.cp_rank, view.cp_size) == (2, 3)
    # The keys 0.5.18 sends too, under the same names.
    assert set(view.values) == {
        "sglang", "page_size", "host_layout", "device_pages", "host_pool_slots", "copy_path", "copy_backend",
        "l3", SETTINGS_KEY, HOST_TAIL_KEY,
    }
    assert (HOST_POOL_SLOTS_KEY, COPY_PATH_KEY, COPY_BACKEND_KEY, L3_KEY) == (
        "host_pool_slots", "copy_path", "copy_backend", "l3")
    assert view.values[HOST_TAIL_KEY] == "covering"  # the default
    assert view.values["page_size"] == 64 and view.values["device_pages"] == 8
    assert view.values["host_pool_slots"] == 17 * 64 and view.values["host_layout"] == "page_first"
    assert view.values["copy_path"] == COPY_PATH == "library" and view.values[SETTINGS_KEY] == "valid"
    assert view.values["l3"] == "off"
    assert start_up_view(*_stand_ins(2, None), "upstream").values["copy_path"] == "upstream"
    with pytest.raises(ValueError, match="copy_path must be one of \\('library', 'upstream'\\), got 'libary'"):
        start_up_view(*_stand_ins(2, None), "libary")
    assert view.values["copy_backend"] in ("reference", "triton-interpret")


@pytest.mark.parametrize(
    "case, message",
    [
        ("agree", "ok"),
        ("cp_size", "CP ranks disagree on cp_size: group rank 2 (cp_rank 2) has 4, group rank 0 (cp_rank 0) has 3"),
        ("page_size", "CP ranks disagree on page_size: cp_rank 2 has 32, cp_rank 0 has 64; "
         "start every rank with the same page_size"),
        ("duplicate_rank", "cp_rank 1 is claimed by group ranks 1 and 2; "
         "each rank of the CP group needs its own cp_rank in 0..2"),
    ],
)
def test_stand_in_pools_disagreeing_are_refused_on_every_rank(valid_settings, case, message):
    def run(rank: int, pg: Any) -> None:
        odd = rank == 2
        kvcache, group = _stand_ins(
            1 if (odd and case == "duplicate_rank") else rank, pg,
            cp_size=4 if (odd and case == "cp_size") else 3,
            page_size=32 if (odd and case == "page_size") else 64,
        )
        views = agree_at_start_up(kvcache, group, all_gather=object_all_gather)
        assert [v.cp_rank for v in views] == [0, 1, 2]

    assert agreement_on_threads(case, run) == {0: message, 1: message, 2: message}


def test_a_rank_on_another_copy_path_is_refused_on_every_rank(valid_settings):
    """A view injected as a rank on another copy path would send it."""
    message = "CP ranks disagree on copy_path: cp_rank 1 has 'upstream', " \
              "cp_rank 0 has 'library'; start every rank with the same copy_path; " \
              "SGLANG_CP_HICACHE_COPY sets the copy path"

    def run(rank: int, pg: Any) -> None:
        view = start_up_view(*_stand_ins(rank, pg))
        if rank == 1:
            view = replace(view, values={**view.values, COPY_PATH_KEY: "upstream"})
        gather_and_check(view, pg, all_gather=object_all_gather, hints=HINTS)

    assert agreement_on_threads("copy_path", run) == {0: message, 1: message, 2: message}


def test_a_rank_on_another_host_tail_rule_is_refused_on_every_rank(valid_settings):
    """The host room decides alone on each rank: every rank must take the same rule."""
    message = "CP ranks disagree on host tail rule (SGLANG_CP_HICACHE_HOST_TAIL): cp_rank 2 has 'whole', " \
              "cp_rank 0 has 'covering'; start every rank with the same host tail rule (SGLANG_CP_HICACHE_HOST_TAIL)"

    def run(rank: int, pg: Any) -> None:
        view = start_up_view(*_stand_ins(rank, pg))
        if rank == 2:  # as a rank started with SGLANG_CP_HICACHE_HOST_TAIL=whole would send it
            view = replace(view, values={**view.values, HOST_TAIL_KEY: "whole"})
        gather_and_check(view, pg, all_gather=object_all_gather)

    assert agreement_on_threads("host_tail", run) == {0: message, 1: message, 2: message}


def test_the_view_carries_the_host_tail_rule_in_force(valid_settings, monkeypatch):
    monkeypatch.setenv(settings.HOST_TAIL.name, " Whole ")
    assert start_up_view(*_stand_ins(0, None)).values[HOST_TAIL_KEY] == "whole"
    monkeypatch.setenv(settings.HOST_TAIL.name, "tail")  # not a rule: the settings entry names it
    view = start_up_view(*_stand_ins(0, None))
    assert view.values[HOST_TAIL_KEY] == "invalid"
    assert view.values[SETTINGS_KEY].startswith("SGLANG_CP_HICACHE_HOST_TAIL='tail' is not valid; use one of: "
                                                "covering, shortest, whole")


def test_a_view_is_plain_data():
    """It crosses processes through all_gather_object (pickle)."""
    view = start_up_view(*_stand_ins(0, None))
    assert pickle.loads(pickle.dumps(view)) == view and isinstance(view, RankView)
