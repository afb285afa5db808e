"""A kept prefix goes first (the host room's refined tail rule, the default
``SGLANG_CP_HICACHE_HOST_TAIL=covering``), on the real 0.5.23 stack, CP 2
(tests/helpers/sglang_0523/host_room_scenarios.py::prefix_first): a later run short
of a class the kept prefix holds takes the prefix's last page, not an older
leaf's; the older leaf and what stayed of the prefix load back bit-exact;
both ranks agree. The same requests under the two other rules: ``shortest``
(the prefix in LRU order) loses the older leaf; ``whole`` loses the prefix."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang_0523.conftest import RANK_ENV

P = 64
RULES = ("covering", "shortest", "whole")


def _all_rules(rank: int, world: int) -> dict[str, Any]:
    from tests.helpers.sglang_0523.host_room_scenarios import prefix_first

    return {rule: prefix_first(rank, world, rule) for rule in RULES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523.ranks import run_ranks

    return run_ranks(_all_rules, 2, str(tmp_path_factory.mktemp("prefix_first")), env=RANK_ENV)


def _host_pieces(out: dict[str, Any], name: str) -> list[dict[str, Any]]:
    first = out["leaves"][name]["first_token"]
    return [n for n in out["host_nodes"] if n["first_token"] == first]


def _hits(out: dict[str, Any]) -> tuple[int, int]:
    """Host hit tokens of q and a served again."""
    return out["records"][3]["host_hit_tokens"], out["records"][4]["host_hit_tokens"]


def test_the_setup_is_the_one_described(ranks):
    for rank, result in enumerate(ranks):
        for rule in RULES:
            out = result[rule]
            assert out["tail_rule"] == rule, (rank, rule)
            leaves = out["leaves"]
            assert [leaves[n]["owners"] for n in ("q", "a", "b")] == [[0], [1, 0, 1, 0, 1], [0, 1, 0, 1]], rank
            assert leaves["q"]["time"] < leaves["a"]["time"] < leaves["b"]["time"], rank  # LRU order
            assert out["before"]["free"] == [0, 0] and out["fits"] == [True, True], (rank, rule)


def test_a_kept_prefix_gives_its_pages_before_an_older_leaf(ranks):
    for rank, result in enumerate(ranks):
        out = result["covering"]
        a, q = out["leaves"]["a"], out["leaves"]["q"]
        # first run: q (no page of class 1) passed over, a's last page taken, a 4-page prefix kept
        assert out["after_first"]["room"]["leaves_skipped"] == 1 and out["after_first"]["free"] == [0, 1], rank
        # second run (class 0): the prefix gave its last page; q, older, stayed
        assert out["tails_split"] == 2 and out["pages_kept"] == 4 + 3, rank
        assert out["after_second"]["free"] == [1, 1], rank
        assert q["id"] in out["after_second"]["host_leaves"], rank
        (prefix,) = _host_pieces(out, "a")
        assert prefix["tokens"] == 3 * P and prefix["owners"] == a["owners"][:3], rank
        assert prefix["host"] == a["host"][: 3 * P] and prefix["base"] == a["base"], rank
        assert prefix["time"] == a["time"], rank  # upstream's recency untouched
        assert _hits(out) == (P, 3 * P), rank


def test_what_stayed_loads_back_bit_exact_and_the_ranks_agree(ranks):
    for rule in RULES:
        for rank, result in enumerate(ranks):
            out = result[rule]
            assert out["invariant_violations"] == [], (rank, rule)
            assert all(r["corrupted_pages"] == 0 for r in out["records"]), (rank, rule)
            for record in out["records"][3:]:
                assert record["loaded_tokens"] == record["host_hit_tokens"], (rank, rule)
                assert record["restored_pages_verified"] == record["verified_pages"], (rank, rule)
        first, second = ranks[0][rule], ranks[1][rule]
        for key in ("digest", "after_first", "after_second", "host_nodes", "tails_split", "records"):
            if key == "records":  # pages verified are each rank's own
                strip = lambda rs: [{k: v for k, v in r.items() if "verified" not in k} for r in rs]  # noqa: E731
                assert strip(first[key]) == strip(second[key]), (rule, key)
            else:
                assert first[key] == second[key], (rule, key)


def test_the_other_rules_lose_the_older_leaf_or_the_prefix(ranks):
    for rank, result in enumerate(ranks):
        shortest, whole = result["shortest"], result["whole"]
        # shortest: the prefix kept in LRU order; the second run evicts q, older
        assert shortest["tails_split"] == 1, rank
        assert shortest["leaves"]["q"]["id"] not in shortest["after_second"]["host_leaves"], rank
        assert _hits(shortest) == (0, 4 * P), rank
        # whole: a went whole at the first run; the second fits without evicting
        assert whole["tails_split"] == 0 and _host_pieces(whole, "a") == [], rank
        assert whole["after_second"]["room"] == whole["after_first"]["room"], rank
        assert _hits(whole) == (P, 0), rank
