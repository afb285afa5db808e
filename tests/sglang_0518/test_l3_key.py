"""The L3 deployment secret (``SGLANG_CP_HICACHE_L3_KEY_FILE``) through the
0.5.18 adapter's real L3 path: real SGLang stacks, threaded ranks on gloo,
the key file read by ``open_l3`` at each rank's start-up (the same helpers
as ``test_l3.py``: CP 4 writes, CP 2 reads, bytes checked against the
content every token must have). What it pins: :mod:`tests.helpers.l3_key`.
"""

from __future__ import annotations

import logging

import pytest

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.envelope import HEADER_BYTES
from sglang_cp_hicache.sglang_0518.l3_port import balanced_owners
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig

from tests.helpers.l3_key import UNKEYED, keyed_view, digests, forge_without_the_key, key_file, keyed_objects, new_secret
from tests.sglang_0518.test_l3 import (
    PAGES, TOKENS, P, assert_alike, check_restored_whole, cluster, copy_of, object_path, read_back, write_with_cp4,
)

SECRET, OTHER_SECRET = new_secret(), new_secret()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """One directory CP 4 wrote TOKENS to with SECRET; the writer's
    ``describe()``."""
    root = tmp_path_factory.mktemp("l3-keyed")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(settings.L3_KEY_FILE.name, str(key_file(root, SECRET)))
        cl = write_with_cp4(root / "l3", mp)
        try:
            assert sum(c.cp_l3.counters.written_pages for c in cl.caches) == PAGES
            views = {c.cp_l3.describe() for c in cl.caches}
        finally:
            cl.close()
    finally:
        mp.undo()
    assert len(views) == 1
    return root / "l3", views.pop()


def test_the_same_key_restores_the_chain_bit_exact_from_keyed_objects(keyed, tmp_path, monkeypatch):
    directory, writer_view = keyed
    assert writer_view.endswith(keyed_view(SECRET))
    # the reader's key file is another file with the same secret (each host has its own copy)
    monkeypatch.setenv(settings.L3_KEY_FILE.name, str(key_file(tmp_path, SECRET + b"\n")))
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = cluster(2)
    try:
        assert [c.cp_l3.describe() for c in cl.caches] == [writer_view] * 2
        check_restored_whole(cl)
    finally:
        cl.close()
    # every object: format 3, keyed namespace, keyed BLAKE3 tag over header and payload
    assert keyed_objects(directory, SECRET, writer_view) == 2 * PAGES


@pytest.mark.parametrize("pool", ["kv", "indexer"])
def test_a_page_forged_without_the_key_is_refused_and_every_rank_stops_before_it(
    keyed, tmp_path, monkeypatch, caplog, pool
):
    source, _ = keyed
    monkeypatch.setenv(settings.L3_KEY_FILE.name, str(key_file(tmp_path, SECRET)))
    monkeypatch.setenv(settings.L3_DIR.name, str(copy_of(source, tmp_path / "l3")))
    cl = cluster(2)
    try:
        bad = 3
        assert balanced_owners([0, 0], PAGES, P)[bad] == 1  # the forged page is rank 1's
        # the payload of another genuine page of the same pool: plausible bytes, wrong ones here
        forge_without_the_key(object_path(cl, pool, bad), object_path(cl, pool, 0).read_bytes()[HEADER_BYTES:])
        with caplog.at_level(logging.WARNING, logger="sglang_cp_hicache.l3.host_tier"):
            assert read_back(cl) == [bad * P, bad * P]
        assert cl.check(TOKENS) == {}  # every restored token right, on every rank
        assert [c.cp_l3.counters.rejected_pages for c in cl.caches] == [0, 1]  # its owner alone refuses it
        assert sum(c.cp_l3.counters.restored_pages for c in cl.caches) == bad
        refusals = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert len(refusals) == 1 and "rejected (mac)" in refusals[0], refusals
        assert_alike(cl)
    finally:
        cl.close()


@pytest.mark.parametrize("reader", ["another key", "no key"])
def test_a_reader_without_the_writers_key_restores_nothing(keyed, tmp_path, monkeypatch, reader):
    directory, writer_view = keyed
    if reader == "another key":
        monkeypatch.setenv(settings.L3_KEY_FILE.name, str(key_file(tmp_path, OTHER_SECRET)))
    else:
        monkeypatch.delenv(settings.L3_KEY_FILE.name, raising=False)
    monkeypatch.setenv(settings.L3_DIR.name, str(directory))
    cl = cluster(2)
    try:
        view = cl.caches[0].cp_l3.describe()
        if reader == "another key":  # the same names (the secret is in none): found, and every one refused
            assert digests(view) == digests(writer_view) and view.endswith(keyed_view(OTHER_SECRET))
        else:  # another namespace: nothing of the writer's is even looked at
            assert view.endswith(UNKEYED) and not digests(view) & digests(writer_view)
        assert read_back(cl) == [0, 0]
        assert all(not c.root_node.children for c in cl.caches)
        assert cl.check(TOKENS) == {}
        assert all(c.cp_l3.counters.restored_pages == 0 for c in cl.caches)
        # another key: each rank read each of its own pages (all in flight at once) and refused it
        owners = balanced_owners([0, 0], PAGES, P)
        expected = [owners.count(r) for r in range(2)] if reader == "another key" else [0, 0]
        assert [c.cp_l3.counters.rejected_pages for c in cl.caches] == expected
        assert [c.host_slot_ledger.used for c in cl.caches] == [[0, 0], [0, 0]]  # every slot given back
        assert_alike(cl)
    finally:
        cl.close()


@pytest.mark.parametrize("problem,data,mode,message", [
    ("readable by others", SECRET, 0o644, "mode 0644 lets other accounts read or change it"),
    ("too short", SECRET[:20], 0o600, "holds 20 bytes; a key needs at least 32"),
], ids=["mode-0644", "too-short"])  # ids of their own: the secret stays out of the test names
def test_a_bad_key_file_stops_start_up_on_every_rank_without_showing_the_secret(
    tmp_path, monkeypatch, caplog, problem, data, mode, message
):
    from tests.helpers.cp_cluster import RankSetup, build_each_rank

    path = key_file(tmp_path, data, mode)
    monkeypatch.setenv(settings.L3_KEY_FILE.name, str(path))
    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path / "l3"))
    with caplog.at_level(logging.DEBUG):
        outcomes = build_each_rank(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), lambda r: RankSetup(r))
    assert all(isinstance(o, ValueError) for o in outcomes), outcomes
    for o in outcomes:
        text = str(o)
        assert f"SGLANG_CP_HICACHE_L3_KEY_FILE={str(path)!r}" in text and message in text, text
        assert data.decode() not in text and data.decode() not in repr(o)
    assert all(data.decode() not in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "l3").rglob("*.bin"))


def _build_with_key_files(tmp_path, monkeypatch, paths: list) -> list:
    """Each CP 2 rank built with its own key file (``paths[rank]``, read by
    the real reader): the threads share one environment, so the adapter's
    ``seal_from_settings`` gets each rank's own. Each rank's outcome, at
    once (not after the collective timeout)."""
    import time

    from sglang_cp_hicache.l3.auth import seal_from_settings as real
    from sglang_cp_hicache.l3 import opening
    from tests.helpers.cp_cluster import RankSetup, build_each_rank, building_rank

    monkeypatch.setenv(settings.L3_DIR.name, str(tmp_path / "l3"))
    monkeypatch.setattr(opening, "seal_from_settings",
                        lambda: real({settings.L3_KEY_FILE.name: str(paths[building_rank()])}))
    start = time.monotonic()
    outcomes = build_each_rank(CpStackConfig(cp_size=2, device_pages=8, host_pages=10), lambda r: RankSetup(r),
                               timeout_s=120)
    assert time.monotonic() - start < 60  # not the collective timeout
    return outcomes


def test_one_ranks_bad_key_file_stops_every_rank_at_once_naming_it(tmp_path, monkeypatch):
    """Only rank 1's key file is readable by others: rank 1 does not raise
    before the start-up agreement (its peer would wait in the all-gather);
    its problem is its agreement view, so both ranks stop at once, naming it."""
    from sglang_cp_hicache.agreement import CpAgreementError

    bad = key_file(tmp_path, SECRET, 0o644, "open.key")
    outcomes = _build_with_key_files(tmp_path, monkeypatch, [key_file(tmp_path, SECRET), bad])
    assert all(isinstance(o, CpAgreementError) for o in outcomes), outcomes
    for o in outcomes:
        text = str(o)
        assert "disagree on l3" in text and f"SGLANG_CP_HICACHE_L3_KEY_FILE={str(bad)!r}: mode 0644" in text, text
        assert SECRET.decode() not in text


def test_ranks_with_different_secrets_refuse_to_start(tmp_path, monkeypatch):
    """Each host made its own key file: the ranks' namespaces are the same
    (the scheme alone enters them), yet each would refuse the pages the
    other wrote. The agreement compares the secrets' key check values: every rank
    refuses at start-up, showing neither secret."""
    from sglang_cp_hicache.agreement import CpAgreementError

    paths = [key_file(tmp_path, SECRET, name="host0.key"), key_file(tmp_path, OTHER_SECRET, name="host1.key")]
    outcomes = _build_with_key_files(tmp_path, monkeypatch, paths)
    assert all(isinstance(o, CpAgreementError) for o in outcomes), outcomes
    for o in outcomes:
        text = str(o)
        assert "disagree on l3" in text and "|objects:blake3-keyed:kcv=" in text, text
        assert SECRET.decode() not in text and OTHER_SECRET.decode() not in text
    # the same secret in two files (one per host) agrees
    same = [key_file(tmp_path, SECRET, name="copy0.key"), key_file(tmp_path, SECRET + b"\n", name="copy1.key")]
    assert not any(isinstance(o, BaseException) for o in _build_with_key_files(tmp_path, monkeypatch, same))
