"""The owner-aware host room evicts only the tail of a host leaf that a
backup needs, on the real 0.5.23 stack, CP 2: the prefix stays a host node
with the leaf's recency and loads back bit-exact (KV and indexer); a leaf
the split would not carry over whole is evicted whole; both ranks agree."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang_0523.conftest import RANK_ENV

P = 64


def _run(tmp_path_factory: pytest.TempPathFactory, forge_hashes: bool) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523 import host_room_scenarios
    from tests.helpers.sglang_0523.ranks import run_ranks

    return run_ranks(host_room_scenarios.tail_eviction, 2, str(tmp_path_factory.mktemp("host_room_tail")),
                     env=RANK_ENV, forge_hashes=forge_hashes)


@pytest.fixture(scope="module")
def tail(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory, False)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory, True)


def _a_pieces(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Host nodes after the backup that hold a's first tokens."""
    return [n for n in out["host_nodes_after"] if n["first_token"] == out["a"]["first_token"]]


def test_only_the_tail_the_backup_needs_is_evicted(tail):
    for rank, out in enumerate(tail):
        a, before, after = out["a"], out["before"], out["after"]
        assert before["free"] == [0, 0] and a["tokens"] == 6 * P and not a["on_device"], rank
        evicted = after["room"]["pages_evicted"] - before["room"]["pages_evicted"]
        assert after["room"]["leaves_evicted"] - before["room"]["leaves_evicted"] == 1, rank
        assert out["tails_split"] == 1 and out["pages_kept"] == 6 - evicted, rank
        # the evicted tail starts at a's last page of the class the run needed
        # (the page the one-page backup took): no page before it could help
        (prefix,) = _a_pieces(out)
        keep = prefix["tokens"] // P
        assert 1 <= evicted <= 2 and keep == 6 - evicted, rank  # CP 2: a page of each class within 2
        needed = a["owners"][keep]
        assert needed not in a["owners"][keep + 1:], rank
        assert after["free"][needed] == 0, rank  # the backup took the freed page of that class
        # the prefix is a's first pages on the same host slots, a host leaf
        # still under the root, with a's rotation base and a's recency
        assert prefix["host"] == a["host"][: keep * P] and prefix["owners"] == a["owners"][:keep], rank
        assert prefix["base"] == a["base"] and prefix["parent_is_root"] and not prefix["on_device"], rank
        assert prefix["time"] == a["time"] < out["b"]["time"], rank
        assert prefix["id"] in after["host_leaves"] and out["b"]["id"] in after["host_leaves"], rank
        assert out["b"]["id"] in before["host_leaves"], rank  # b (more recent) was left alone


def test_the_prefix_loads_back_bit_exact_and_the_ranks_agree(tail):
    for rank, out in enumerate(tail):
        again = out["records"][-1]  # a again: its kept prefix comes from the host
        keep = out["pages_kept"]
        assert again["device_hit_tokens"] == 0 and again["host_hit_tokens"] == again["loaded_tokens"] == keep * P, rank
        assert again["restored_pages_verified"] >= 1, rank
        assert all(r["corrupted_pages"] == 0 for r in out["records"]), rank
        assert out["indexer_pages_verified"] >= again["verified_pages"] >= again["restored_pages_verified"], rank
        assert out["invariant_violations"] == [], rank
    first, second = tail
    for key in ("digest", "before", "after", "host_nodes_after", "tails_split", "pages_kept", "records"):
        assert first[key] == second[key], key


def test_a_leaf_whose_hashes_do_not_match_its_pages_is_evicted_whole(whole):
    for rank, out in enumerate(whole):
        before, after = out["before"], out["after"]
        assert out["tails_split"] == 0 and out["pages_kept"] == 0, rank
        assert after["room"]["leaves_evicted"] - before["room"]["leaves_evicted"] == 1, rank
        assert after["room"]["pages_evicted"] - before["room"]["pages_evicted"] == 6, rank
        assert _a_pieces(out) == [] and out["a"]["id"] not in after["host_leaves"], rank
        assert out["b"]["id"] in after["host_leaves"], rank
        again = out["records"][-1]
        assert again["host_hit_tokens"] == 0 and again["corrupted_pages"] == 0, rank
        assert out["invariant_violations"] == [], rank
    assert whole[0]["digest"] == whole[1]["digest"]
