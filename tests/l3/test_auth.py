"""Authenticated L3 objects: with a deployment secret, nobody who can write
the store but lacks the secret can get a page restored; the secret is in no
name, message or repr; the key file is refused unless only its owner can
read it."""

from __future__ import annotations

import os
import stat
import threading

import blake3
import pytest
import torch
import xxhash

from sglang_cp_hicache import settings
from sglang_cp_hicache.l3.auth import UNKEYED, ObjectSeal, load_secret, seal_from_settings
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, HEADER_FIELDS, TAG_OFFSET, Rejection, check_object, pack, unpack
from sglang_cp_hicache.l3.keys import page_key
from sglang_cp_hicache.l3.store import FilePageStore
from tests.l3.common import namespace, payload, write_chain

# Random bytes between two non-whitespace ends: a key file's surrounding
# whitespace is stripped, so a secret ending in a whitespace byte (one run in
# ~40 with 24 random bytes at the end) would read back as another secret.
SECRET = b"s" * 16 + os.urandom(24) + b"e"
OTHER_SECRET = b"o" + os.urandom(32) + b"e"
KEYED = ObjectSeal.keyed(SECRET)
NS = namespace(seal=KEYED)
KEY = page_key("1" * 64, NS)


def _reason(result: object) -> str:
    assert isinstance(result, Rejection), "a forged or damaged object was accepted"
    return result.reason


def _key_file(tmp_path, data: bytes = SECRET, mode: int = 0o600, name: str = "l3.key"):
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


# ---- forgery ------------------------------------------------------------------------------

def _forge(blob: bytes, fake: torch.Tensor, tag: bytes) -> bytes:
    """What anyone who can write the store can do: keep the public header
    fields, put their own bytes in, and the best tag they can make."""
    return blob[:TAG_OFFSET] + tag + fake.numpy().tobytes()


def _forged_tags(head: bytes, fake: torch.Tensor) -> dict[str, bytes]:
    body = fake.numpy().tobytes()
    return {
        "xxh3 checksum (what an unkeyed store accepts)": xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
        + bytes(24),
        "unkeyed blake3 over header and payload": blake3.blake3(head + body).digest(),
        "another deployment's secret": ObjectSeal.keyed(OTHER_SECRET).tag(head, [memoryview(body)]),
        "the secret itself as the key (not the derived one)": blake3.blake3(head + body, key=SECRET[:32]).digest(),
    }


def test_a_forged_object_with_a_valid_checksum_is_refused_with_a_key():
    blob = pack(KEY, NS, payload(NS, 1))
    fake = payload(NS, 666)
    for what, tag in _forged_tags(blob[:TAG_OFFSET], fake).items():
        assert _reason(unpack(KEY, NS, _forge(blob, fake, tag))) == "mac", what
        head = memoryview(_forge(blob, fake, tag)[:HEADER_BYTES])
        assert check_object(KEY, NS, head, memoryview(fake.numpy().tobytes())).reason == "mac", what


def test_without_a_key_the_same_forgery_passes_which_is_why_the_key_exists():
    """The threat the key closes: an unkeyed namespace restores a forged
    page whose checksum was recomputed (docs/l3.md's threat model)."""
    ns = namespace()
    key = page_key("1" * 64, ns)
    blob = pack(key, ns, payload(ns, 1))
    fake = payload(ns, 666)
    forged = _forge(blob, fake, _forged_tags(blob[:TAG_OFFSET], fake)["xxh3 checksum (what an unkeyed store accepts)"])
    assert torch.equal(unpack(key, ns, forged), fake)


def test_every_header_and_payload_bit_is_covered_by_the_mac():
    blob = bytearray(pack(KEY, NS, payload(NS, 2)))
    assert torch.equal(unpack(KEY, NS, bytes(blob)), payload(NS, 2))
    start, end = HEADER_FIELDS["tag"]
    for bit in list(range(start * 8, end * 8)) + [HEADER_BYTES * 8 + b for b in (0, 7, 1000, NS.page_bytes * 8 - 1)]:
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert _reason(unpack(KEY, NS, bytes(flipped))) == "mac", bit


def test_the_mac_binds_the_header_fields_it_does_not_compare_itself():
    """A tag is over the header too: moved under another page's key (its
    header rewritten to match), a sound object of one page is no object of
    another."""
    other_key = page_key("2" * 64, NS)
    blob = bytearray(pack(KEY, NS, payload(NS, 3)))
    start, end = HEADER_FIELDS["key"]
    blob[start:end] = other_key.encode().ljust(end - start, b"\0")
    assert _reason(unpack(other_key, NS, bytes(blob))) == "mac"


def test_keyed_and_unkeyed_deployments_never_share_a_namespace_and_the_secret_is_in_none():
    plain, other = namespace(), namespace(seal=ObjectSeal.keyed(OTHER_SECRET))
    assert plain.digest() != NS.digest()
    assert other.digest() == NS.digest()  # the scheme enters the namespace, the secret does not
    assert other != NS and plain != NS  # ...but the namespaces are not equal
    assert SECRET.hex() not in repr(NS) and "blake3-keyed" in repr(KEYED)
    assert repr(KEYED) == "ObjectSeal('blake3-keyed')"


# ---- the key file --------------------------------------------------------------------------

def test_a_key_file_only_its_owner_reads_gives_the_keyed_seal(tmp_path):
    path = _key_file(tmp_path, SECRET + b"\n")
    env = {settings.L3_KEY_FILE.name: str(path)}
    assert seal_from_settings(env) == KEYED  # surrounding whitespace is not part of the secret
    assert seal_from_settings({}) is UNKEYED
    link = tmp_path / "link"
    link.symlink_to(path)  # Kubernetes mounts secrets through symlinks
    assert seal_from_settings({settings.L3_KEY_FILE.name: str(link)}) == KEYED


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666])
def test_a_key_file_other_accounts_can_read_or_change_is_refused(tmp_path, mode):
    path = _key_file(tmp_path, mode=mode)
    with pytest.raises(ValueError, match=rf"SGLANG_CP_HICACHE_L3_KEY_FILE=.*mode 0{mode:o}.*chmod 600") as err:
        load_secret(str(path))
    assert SECRET.decode("latin-1") not in str(err.value)


def test_a_short_missing_or_odd_key_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="holds 31 bytes; a key needs at least 32"):
        load_secret(str(_key_file(tmp_path, b"x" * 31)))
    with pytest.raises(ValueError, match="cannot open the key file"):
        load_secret(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="not a regular file"):
        load_secret(str(tmp_path))
    with pytest.raises(ValueError, match="not a key file"):
        load_secret(str(_key_file(tmp_path, b"x" * 5000, name="big")))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    result: list[BaseException] = []
    reader = threading.Thread(target=lambda: _catch(result, load_secret, str(fifo)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "opening a FIFO as the key file blocked"
    assert "not a regular file" in str(result[0])


def _catch(out: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 (the test reads it)
        out.append(exc)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a file as another account")
def test_a_key_file_owned_by_another_account_is_refused(tmp_path):
    path = _key_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match="owned by uid 65534"):
        load_secret(str(path))


def test_the_secret_never_reaches_the_settings_table(tmp_path, monkeypatch):
    path = _key_file(tmp_path)
    monkeypatch.setenv(settings.L3_KEY_FILE.name, str(path))
    table = settings.describe()
    assert str(path) in table and SECRET.decode("latin-1") not in table
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# ---- a whole tier on a shared file store ------------------------------------------------------

def test_a_forged_page_on_disk_is_never_restored(tmp_path):
    """A keyed writer stores its pages; someone who can write the directory
    rewrites one page's KV object with their own bytes and a recomputed
    checksum. The keyed reader refuses it (counted); its sound pages still
    read bit-exact."""
    from tests.l3.test_host_tier import HASHES, OWNERS, P, _own_slots, _page, _tier

    store = FilePageStore(tmp_path / "l3")
    writer = _tier(store, 1, seed=11, seal=KEYED)
    assert write_chain(writer, HASHES, OWNERS, _own_slots(1)) == 3
    kv_key = page_key(HASHES[2], writer.kv_ns, HASHES[1])  # rank 1's second page: chain page 2
    path = store.path_of(kv_key)
    blob = path.read_bytes()
    fake = payload(writer.kv_ns, 666)
    forged = _forge(blob, fake, _forged_tags(blob[:TAG_OFFSET], fake)["xxh3 checksum (what an unkeyed store accepts)"])
    path.write_bytes(forged)

    reader = _tier(store, 1, seed=5, poisoned=True, seal=KEYED)
    idx_key = page_key(HASHES[2], writer.indexer_ns, HASHES[1])
    # Refused: the rows reserved for it are no page (the fetch frees them unused).
    assert not reader.read_page(kv_key, idx_key, P, lambda fn: fn())
    assert reader.counters.rejected_pages == 1 and reader.counters.fetched_pages == 0
    good_kv = page_key(HASHES[1], writer.kv_ns, HASHES[0])
    good_idx = page_key(HASHES[1], writer.indexer_ns, HASHES[0])
    assert reader.read_page(good_kv, good_idx, 0, lambda fn: fn())
    assert torch.equal(_page(reader, 0)[0], _page(writer, 0)[0])


def test_keyed_and_unkeyed_tiers_on_one_store_never_read_each_others_objects(tmp_path):
    from tests.l3.test_host_tier import HASHES, OWNERS, _own_slots, _tier

    store = FilePageStore(tmp_path / "l3")
    keyed = _tier(store, 0, seed=11, seal=KEYED)
    plain = _tier(store, 0, seed=12)
    assert write_chain(keyed, HASHES, OWNERS, _own_slots(0)) == 3
    assert plain.query_pages(HASHES, OWNERS) == 0  # a miss, not a rejection
    assert write_chain(plain, HASHES, OWNERS, _own_slots(0)) == 3
    assert plain.counters.written_pages == 3  # its own objects, beside the keyed ones
    assert len(list(store.directory.rglob("*.bin"))) == 2 * 2 * 3
    stranger = _tier(store, 0, seed=13, seal=ObjectSeal.keyed(OTHER_SECRET))
    kv_key, idx_key = page_key(HASHES[0], stranger.kv_ns), page_key(HASHES[0], stranger.indexer_ns)
    assert stranger.store.exists([kv_key, idx_key]) == [True, True]  # same names as the keyed deployment's...
    assert not stranger.read_page(kv_key, idx_key, 0, lambda fn: fn())
    assert stranger.counters.rejected_pages == 1  # ...refused by the MAC


def test_the_key_check_value_tells_secrets_apart_and_nothing_of_them(tmp_path):
    from tests.l3.test_host_tier import _tier

    store = FilePageStore(tmp_path / "l3")
    a, b = ObjectSeal.keyed(SECRET), ObjectSeal.keyed(OTHER_SECRET)
    assert a.check_value() == KEYED.check_value() != b.check_value()
    assert len(a.check_value()) == 8 and UNKEYED.check_value() == ""
    views = {_tier(store, 0, seed=1, seal=seal).describe() for seal in (a, b, UNKEYED)}
    assert len(views) == 3  # ranks that name different secrets disagree at start-up
    assert all(SECRET.hex() not in v and SECRET.decode("latin-1") not in v for v in views)
    assert _tier(store, 0, seed=1, seal=a).describe().endswith(f"|objects:blake3-keyed:kcv={a.check_value()}")
