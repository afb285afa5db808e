"""The L3 deployment secret in the release tests: key files, a forger
without the key, and the check that every object on disk is keyed.

Release-neutral (no SGLang import): the 0.5.18 tests use it in-process, the
0.5.23 rank processes and tests alike. What both releases' key tests pin:

* the same key on writer and reader: the chain is restored bit-exact, the
  tier's ``describe()`` (start-up log and agreement) ends with
  ``objects:blake3-keyed``, and every object on disk is format 3 with the
  keyed BLAKE3 tag over header and payload;
* a page object rewritten by someone without the key (other bytes, the
  XXH3 tag they can compute): its owner refuses it (``mac``), every rank
  restores the same prefix before it, nothing wrong is restored;
* a reader with another key: same object names, its own objects refused; a
  reader without a key: another namespace, a plain miss;
* a bad key file stops start-up on every rank, naming the setting and the
  problem, never showing the secret (not in the error, not in the log);
  on one rank only, every rank stops at the start-up agreement, naming it;
* ranks with different secrets (a key file made per host) refuse to start.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import xxhash

from sglang_cp_hicache.l3.auth import ObjectSeal
from sglang_cp_hicache.l3.envelope import FORMAT_VERSION, HEADER_BYTES, HEADER_FIELDS, MAGIC, TAG_OFFSET

__all__ = ["UNKEYED", "keyed_view", "digests", "forge_without_the_key", "key_file", "keyed_objects", "new_secret",
           "xxh3_tag"]

#: How a tier's start-up agreement value (``describe()``) ends without a key.
UNKEYED = "|objects:xxh3-64"


def keyed_view(secret: bytes) -> str:
    """How the agreement value ends with ``secret``: the scheme and the
    secret's key check value."""
    return f"|objects:blake3-keyed:kcv={ObjectSeal.keyed(secret).check_value()}"


def new_secret() -> bytes:
    """A secret as ``openssl rand -hex 32`` writes it: printable, so a leak
    into a message or log is found by a substring search."""
    return secrets.token_hex(32).encode()


def key_file(directory: Path, data: bytes, mode: int = 0o600, name: str = "l3.key") -> Path:
    path = Path(directory) / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


def digests(describe: str) -> set[str]:
    """The two namespace digests of a tier's start-up agreement value."""
    kv, idx, _ = describe.split("|")
    return {kv.removeprefix("kv:"), idx.removeprefix("indexer:")}


def xxh3_tag(payload: bytes | memoryview) -> bytes:
    """The tag an unkeyed namespace expects: the payload's XXH3-64,
    little-endian, zero-padded to the tag field."""
    return xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") + bytes(HEADER_BYTES - TAG_OFFSET - 8)


def forge_without_the_key(path: Path, payload: bytes) -> None:
    """What anyone who can write the store can do without the key: keep the
    object's public header fields, put ``payload`` in, with the best tag
    they can compute (the unkeyed one)."""
    blob = Path(path).read_bytes()
    if len(payload) != len(blob) - HEADER_BYTES:
        raise ValueError(f"payload of {len(payload)} bytes for an object of {len(blob) - HEADER_BYTES}")
    Path(path).write_bytes(blob[:TAG_OFFSET] + xxh3_tag(payload) + payload)


def keyed_objects(directory: Path, secret: bytes, describe: str) -> int:
    """Assert every object under ``directory`` is format 3 in the keyed
    namespaces of ``describe``, its tag the keyed BLAKE3 of header and
    payload under ``secret`` (not the payload's XXH3); returns how many."""
    seal = ObjectSeal.keyed(secret)
    names = digests(describe)
    objects = sorted(Path(directory).rglob("*.bin"))
    start, end = HEADER_FIELDS["version"]
    for path in objects:
        blob = path.read_bytes()
        head, payload = blob[:HEADER_BYTES], memoryview(blob)[HEADER_BYTES:]
        assert head[:len(MAGIC)] == MAGIC, path
        assert int.from_bytes(head[start:end], "little") == FORMAT_VERSION == 3, path
        assert path.stem.split("_")[1] in names, path
        tag = head[TAG_OFFSET:HEADER_BYTES]
        assert tag == seal.tag(head[:TAG_OFFSET], [payload]), path
        assert tag != xxh3_tag(payload), path
    return len(objects)
