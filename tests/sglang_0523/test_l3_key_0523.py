"""The L3 deployment secret (``SGLANG_CP_HICACHE_L3_KEY_FILE``) through the
0.5.23 adapter's real L3 path: 2 rank processes, each building the sharded
stack through the library strategy (whose ``open_l3`` reads the key file)
and serving one chain with the scheduler's storage calls
(:func:`tests.helpers.sglang_0523.l3_key_scenarios.key_suite`); every
restored page is checked byte by byte on its owner. What it pins:
:mod:`tests.helpers.l3_key`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.l3_key import UNKEYED, keyed_view, digests, key_file, keyed_objects, new_secret
from tests.helpers.sglang_0523 import l3_key_scenarios as scenarios

P, PAGES, FORGED = scenarios.P, scenarios.PAGES, scenarios.FORGED
SECRET, OTHER_SECRET = new_secret(), new_secret()
#: (key file bytes, mode, what the error must say)
BAD_KEYS = {
    "mode-0644": (SECRET, 0o644, "mode 0644 lets other accounts read or change it; chmod 600 (or 400) it"),
    "too-short": (SECRET[:20], 0o600, "holds 20 bytes; a key needs at least 32"),
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.helpers.sglang_0523.ranks import run_ranks

    workdir = tmp_path_factory.mktemp("l3-key-0523")
    keys = tmp_path_factory.mktemp("keys")
    bad = {name: str(key_file(keys, data, mode, name)) for name, (data, mode, _) in BAD_KEYS.items()}
    ranks = run_ranks(
        scenarios.key_suite, 2, str(workdir), timeout_s=300, root=str(workdir),
        key=str(key_file(keys, SECRET)), other_key=str(key_file(keys, OTHER_SECRET, name="other.key")),
        bad_keys=bad,
    )
    return {"root": workdir, "ranks": ranks, "bad": bad}


def _runs(suite: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Both ranks' runs of ``name``, checked alike (the same tree, the same
    hit) and sound (no invariant broken, no page corrupted)."""
    runs = [r[name] for r in suite["ranks"]]
    assert len({r["digest"] for r in runs}) == 1, name
    assert len({r["l3_hit_tokens"] for r in runs}) == 1, name
    assert len({tuple(map(tuple, r["owners"])) for r in runs}) == 1, name
    for rank, run in enumerate(runs):
        assert run["invariant_violations"] == [], (name, rank)
        assert run["corrupted_pages"] == 0, (name, rank)
        assert run["counters"]["prefetches"] == 1, (name, rank)  # one lookup (the writer's: a miss)
    return runs


def _owned(runs: list[dict[str, Any]]) -> list[int]:
    """How many of the chain's pages each rank owns in the (one) lookup."""
    (owners,) = runs[0]["owners"]
    assert len(owners) == PAGES
    return [owners.count(r) for r in range(2)]


# The module's suite (2 rank processes, 10 stack builds) runs in the first test's setup:
# 27-34 s on 2 busy cores, 47 s on one.
@pytest.mark.slow(35)
def test_the_same_key_restores_the_chain_bit_exact_from_keyed_objects(suite):
    writes = _runs(suite, "write")
    views = {r["describe"] for r in writes}
    assert len(views) == 1 and views.pop().endswith(keyed_view(SECRET))
    assert sum(r["counters"]["written_pages"] for r in writes) == PAGES
    runs = _runs(suite, "same_key")
    assert [r["describe"] for r in runs] == [writes[0]["describe"]] * 2
    owned = _owned(runs)
    for rank, run in enumerate(runs):
        c = run["counters"]
        assert run["l3_hit_tokens"] == PAGES * P, rank
        assert (c["restored_pages"], c["fetched_pages"], c["rejected_pages"]) == (owned[rank], owned[rank], 0), rank
        assert run["l3_pages_verified"] == owned[rank] > 0, rank  # every own restored page checked on the device
    # every object: format 3, keyed namespace, keyed BLAKE3 tag over header and payload
    assert keyed_objects(suite["root"] / "keyed", SECRET, writes[0]["describe"]) == 2 * PAGES


@pytest.mark.parametrize("pool", ["kv", "indexer"])
def test_a_page_forged_without_the_key_is_refused_and_every_rank_stops_before_it(suite, pool):
    runs = _runs(suite, f"forged_{pool}")
    (owners,) = runs[0]["owners"]
    owner = owners[FORGED]
    owned_before = [owners[:FORGED].count(r) for r in range(2)]
    for rank, run in enumerate(runs):
        c = run["counters"]
        assert run["l3_hit_tokens"] == FORGED * P, rank  # the restored prefix stops before the forged page
        assert c["rejected_pages"] == (1 if rank == owner else 0), rank  # its owner alone refuses it
        assert [m.split("rejected (")[1][:4] for m in run["refusals"]] == (["mac)"] if rank == owner else []), rank
        assert c["restored_pages"] == owned_before[rank], rank
        assert run["l3_pages_verified"] == owned_before[rank], rank
    # the forged copy differs from the writer's objects in that one object only
    root = suite["root"]
    changed = [p.relative_to(root / f"forged_{pool}") for p in sorted((root / f"forged_{pool}").rglob("*.bin"))
               if p.read_bytes() != (root / "keyed" / p.relative_to(root / f"forged_{pool}")).read_bytes()]
    keys = runs[0][f"{pool}_keys"]
    assert [p.stem for p in changed] == [keys[FORGED]]


@pytest.mark.parametrize("reader", ["other_key", "no_key"])
def test_a_reader_without_the_writers_key_restores_nothing(suite, reader):
    writer_view = suite["ranks"][0]["write"]["describe"]
    runs = _runs(suite, reader)
    view = runs[0]["describe"]
    if reader == "other_key":  # the same names (the secret is in none): found, and refused
        assert digests(view) == digests(writer_view) and view.endswith(keyed_view(OTHER_SECRET))
        assert runs[0]["kv_keys"] == suite["ranks"][0]["write"]["kv_keys"]
    else:  # another namespace: nothing of the writer's is even looked at
        assert view.endswith(UNKEYED) and not digests(view) & digests(writer_view)
    for rank, run in enumerate(runs):
        c = run["counters"]
        assert run["l3_hit_tokens"] == 0 and c["restored_pages"] == 0 and c["fetched_pages"] == 0, rank
    if reader == "other_key":  # each rank read each own page (all in flight at once) and refused it
        assert [r["counters"]["rejected_pages"] for r in runs] == _owned(runs)
        assert all("rejected (mac)" in m for r in runs for m in r["refusals"])
        assert [len(r["refusals"]) for r in runs] == _owned(runs)
    else:
        assert all(r["counters"]["rejected_pages"] == 0 and r["refusals"] == [] for r in runs)


@pytest.mark.parametrize("name", sorted(BAD_KEYS))
def test_a_bad_key_file_stops_start_up_on_every_rank_without_showing_the_secret(suite, name):
    data, _, problem = BAD_KEYS[name]
    path = suite["bad"][name]
    for rank, out in enumerate(r[f"bad:{name}"] for r in suite["ranks"]):
        error = out["error"]
        assert error is not None, rank  # the stack was not built
        assert error.startswith("ValueError: ") and f"SGLANG_CP_HICACHE_L3_KEY_FILE={path!r}: {problem}" in error, (
            rank, error)
        assert data.decode() not in error, rank
        assert not any(data.decode() in line for line in out["log"]), rank
    assert not (suite["root"] / "never").exists() or not list((suite["root"] / "never").rglob("*.bin"))


def test_one_ranks_bad_key_file_stops_every_rank_at_once_naming_it(suite):
    """Only rank 1's key file is readable by others: rank 1 does not raise
    before the start-up agreement (rank 0 would wait in the all-gather); its
    problem is its agreement view, so both ranks stop at once, naming it."""
    path = suite["bad"]["mode-0644"]
    for rank, out in enumerate(r["bad:rank-1"] for r in suite["ranks"]):
        error = out["error"]
        assert out["seconds"] < 60, rank  # not the collective timeout
        assert error is not None and error.startswith("CpAgreementError: ") and "disagree on l3" in error, rank
        assert f"SGLANG_CP_HICACHE_L3_KEY_FILE={path!r}: mode 0644" in error, (rank, error)
        assert SECRET.decode() not in error and not any(SECRET.decode() in line for line in out["log"]), rank


def test_ranks_with_different_secrets_refuse_to_start(suite):
    """Each host made its own key file: the ranks' namespaces are the same
    (the scheme alone enters them), yet each would refuse the pages the
    other wrote. The agreement compares the secrets' key check values: every rank
    refuses at start-up, showing neither secret."""
    for rank, out in enumerate(r["two_secrets"] for r in suite["ranks"]):
        error = out["error"]
        assert out["seconds"] < 60, rank  # not the collective timeout
        assert error is not None and error.startswith("CpAgreementError: ") and "disagree on l3" in error, rank
        assert "|objects:blake3-keyed:kcv=" in error, (rank, error)
        for secret in (SECRET, OTHER_SECRET):
            assert secret.decode() not in error and not any(secret.decode() in line for line in out["log"]), rank
