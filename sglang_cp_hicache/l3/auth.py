"""Who may have written an L3 object: the seal every object carries.

Everything a reader compares in an object's header (magic, version,
namespace digest, key, length) is public -- the digest and key are in the
object's name -- so a checksum only catches damage: anyone who can write
the store can forge a page whose checksum holds. A deployment secret closes
that: with one, every object carries a keyed MAC over its header and
payload, and a reader publishes no byte whose MAC does not hold.

Two seals (:class:`ObjectSeal`):

* ``xxh3-64`` (no secret): XXH3-64 of the payload. Catches damage, not
  forgery.
* ``blake3-keyed``: keyed BLAKE3 (256-bit tag) over the header's fields and
  the payload, with a key derived from the secret file. Chosen by
  ``bench/bench_l3.py --macs`` on this project's page sizes: 2-5 GB/s per
  core, releasing the GIL so I/O threads scale, against 0.6-1.3 GB/s for
  HMAC-SHA256 and keyed BLAKE2b.

The seal's scheme (never the secret) enters the namespace digest, so keyed
and unkeyed deployments never open each other's objects; deployments with
different secrets share keys, and each rejects the other's objects (counted
as rejections, replaced when written again).

The secret (``SGLANG_CP_HICACHE_L3_KEY_FILE``) is read from a file only,
never from the environment or the command line (both are visible to other
processes and end up in logs): the file must be a regular file owned by the
server's account or root, with no group or other permission bits, holding
at least 32 bytes (``head -c 32 /dev/urandom > FILE && chmod 600 FILE``;
text such as ``openssl rand -hex 32`` works too, surrounding whitespace
ignored). A symlink to such a file is followed (Kubernetes mounts secrets
through symlinks): the file it names is what is checked.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Sequence
from typing import Mapping, Optional

import blake3
import xxhash

from sglang_cp_hicache.settings import L3_KEY_FILE, read

__all__ = [
    "MIN_SECRET_BYTES", "ObjectSeal", "TAG_BYTES", "UNKEYED", "checksum", "checksum_parts", "load_secret",
    "seal_from_settings",
]

#: Bytes of the tag field in every object's header (a BLAKE3 output).
TAG_BYTES = 32
#: A shorter secret could be guessed; 32 bytes is BLAKE3's key size.
MIN_SECRET_BYTES = 32
#: Larger files are not secrets (a misnamed weight file, say): refused unread.
_MAX_SECRET_BYTES = 4096
_PAD = bytes(TAG_BYTES - 8)
#: BLAKE3's key derivation context: binds the key to this use alone, so the
#: same secret used elsewhere yields an unrelated key.
_KDF_CONTEXT = "sglang-cp-hicache 2026-12 L3 object MAC v1"


def checksum(data: memoryview) -> int:
    """XXH3-64 of ``data``: 4-13 GB/s on one core (CRC-32 of zlib: 1.3-1.8 on
    the same machine; crc32c and isal 3.4-6; measured in bench/bench_l3.py),
    and SGLang already depends on ``xxhash``. Random damage passes with
    probability 2^-64; a forger passes always (it is no MAC)."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_parts(parts: Sequence[memoryview]) -> int:
    """:func:`checksum` of the concatenation of ``parts`` (a page's bytes
    where they lie in a host pool: one run per layer), without joining them."""
    if len(parts) == 1:
        return checksum(parts[0])
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.intdigest()


class ObjectSeal:
    """How a namespace's objects are sealed and checked (see the module doc).
    Holds the derived key, never shows it (``repr`` names the scheme only)."""

    def __init__(self, scheme: str, key: Optional[bytes] = None) -> None:
        if scheme == "xxh3-64":
            if key is not None:
                raise ValueError("the xxh3-64 seal takes no key")
        elif scheme == "blake3-keyed":
            if not isinstance(key, bytes) or len(key) != 32:
                raise ValueError("the blake3-keyed seal needs a 32-byte derived key")
        else:
            raise ValueError(f"scheme must be 'xxh3-64' or 'blake3-keyed', got {scheme!r}")
        self.scheme = scheme
        self._key = key

    @classmethod
    def keyed(cls, secret: bytes) -> "ObjectSeal":
        """The keyed seal of a deployment secret (at least 32 bytes)."""
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes")
        return cls("blake3-keyed", blake3.blake3(secret, derive_key_context=_KDF_CONTEXT).digest())

    @property
    def authenticates(self) -> bool:
        """Whether a forged object is refused (not only a damaged one)."""
        return self._key is not None

    def __repr__(self) -> str:
        return f"ObjectSeal({self.scheme!r})"

    def check_value(self) -> str:
        """A key check value: 8 hex of a MAC of a fixed text under the key
        ("" without one). Ranks and deployments compare it to find one that
        names another secret, at start-up rather than by refusals later; it
        tells nothing of the secret (a BLAKE3 output under a derived key)."""
        if self._key is None:
            return ""
        return blake3.blake3(b"sglang-cp-hicache key check value", key=self._key).hexdigest()[:8]

    def describe(self) -> str:
        """The scheme, and the key check value where there is a key."""
        return f"{self.scheme}:kcv={self.check_value()}" if self._key is not None else self.scheme

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectSeal):
            return NotImplemented
        same_key = (self._key is None and other._key is None) or (
            self._key is not None and other._key is not None and hmac.compare_digest(self._key, other._key))
        return self.scheme == other.scheme and same_key

    def __hash__(self) -> int:
        return hash(self.scheme)

    def tag(self, head: memoryview | bytes, parts: Sequence[memoryview]) -> bytes:
        """The :data:`TAG_BYTES` tag of an object: ``head`` is its header up
        to the tag field, ``parts`` its payload in order."""
        if self._key is None:  # damage only: the header's fields are compared exactly instead
            return checksum_parts(parts).to_bytes(8, "little") + _PAD
        mac = blake3.blake3(head, key=self._key)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def matches(self, stored: bytes, head: memoryview | bytes, parts: Sequence[memoryview]) -> bool:
        """Whether ``stored`` is the object's tag (compared in constant time)."""
        return hmac.compare_digest(stored, self.tag(head, parts))


#: The seal without a secret.
UNKEYED = ObjectSeal("xxh3-64")


def load_secret(path: str) -> bytes:
    """The secret in the key file at ``path`` (see the module doc for what
    is accepted); ValueError naming the file and what is wrong otherwise.
    The secret itself is never in a message."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ValueError(f"{L3_KEY_FILE.name}={path!r}: cannot open the key file: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        problem = _key_file_problem(st)
        if problem:
            raise ValueError(f"{L3_KEY_FILE.name}={path!r}: {problem}")
        data = b""
        while len(data) <= _MAX_SECRET_BYTES:
            chunk = os.read(fd, _MAX_SECRET_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_BYTES:
        raise ValueError(f"{L3_KEY_FILE.name}={path!r}: more than {_MAX_SECRET_BYTES} bytes: not a key file")
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{L3_KEY_FILE.name}={path!r}: holds {len(secret)} bytes; a key needs at least {MIN_SECRET_BYTES} "
            f"(head -c 32 /dev/urandom > FILE && chmod 600 FILE)"
        )
    return secret


def _key_file_problem(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this server's account (uid {os.geteuid()}) or root"
    if st.st_mode & 0o077:
        return (f"mode {stat.S_IMODE(st.st_mode):04o} lets other accounts read or change it; "
                f"chmod 600 (or 400) it")
    return ""


def seal_from_settings(environ: Optional[Mapping[str, str]] = None) -> ObjectSeal:
    """The seal ``SGLANG_CP_HICACHE_L3_KEY_FILE`` asks for: keyed when it
    names a key file, :data:`UNKEYED` when empty."""
    path = read(L3_KEY_FILE, environ)
    return ObjectSeal.keyed(load_secret(path)) if path else UNKEYED
