"""The object stored per page: a fixed header, then the page's bytes.

Header (little-endian, 164 bytes, no padding)::

    magic        8 s   b"CPHCL3PG"
    version      u16   FORMAT_VERSION
    namespace   16 s   namespace digest (ASCII hex)
    key         98 s   page key (ASCII, NUL-padded)
    payload_len  u64   payload bytes that follow
    tag         32 s   the namespace's seal (``l3.auth``): XXH3-64 of the
                       payload (zero-padded), or with a deployment secret
                       keyed BLAKE3 over every header field above and the
                       payload

Every header byte is either compared exactly with what the reader expects
(magic, version, namespace, key and its padding, and the length against both
the bytes that follow and the namespace's page size) or is the tag, so one
flipped bit anywhere is refused; with a secret, so is any object its holder
did not write. ``unpack`` never raises on corrupt data and never returns
bytes that fail any check: the caller gets a :class:`Rejection`. An object
of another format version (2: an 8-byte checksum; 1: CRC-32, shorter keys)
has another size and another key: it reads as a miss, never as a page.

Writers send :func:`header` and the payload's own bytes in one gather write
(no packed copy); readers read the header and the payload into buffers of
their own (a scatter read) and check them with :func:`check_object`.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Union

import torch

from sglang_cp_hicache.l3.auth import TAG_BYTES, checksum, checksum_parts
from sglang_cp_hicache.l3.keys import KEY_CHARS, DIGEST_CHARS, L3Namespace, check_page_key

__all__ = [
    "FORMAT_VERSION", "HEADER_BYTES", "HEADER_FIELDS", "MAGIC", "REASONS", "TAG_OFFSET", "Rejection", "byte_view",
    "check_object", "checksum", "checksum_parts", "header", "pack", "unpack",
]

MAGIC = b"CPHCL3PG"
#: 2: XXH3-64 checksum, keys with their parent link. 3: a 32-byte tag (the
#: namespace's seal: a checksum, or a keyed MAC over header and payload).
FORMAT_VERSION = 3
_FIELDS = struct.Struct(f"<8sH{DIGEST_CHARS}s{KEY_CHARS}sQ")  # what the tag covers, with the payload
#: Where the tag starts: every header byte before it is covered by a keyed tag.
TAG_OFFSET = _FIELDS.size
HEADER_BYTES = TAG_OFFSET + TAG_BYTES
#: Byte span ``[start, end)`` of each header field (tests flip every bit).
HEADER_FIELDS: dict[str, tuple[int, int]] = {}
_offset = 0
for _name, _size in (("magic", 8), ("version", 2), ("namespace", DIGEST_CHARS),
                     ("key", KEY_CHARS), ("payload_len", 8), ("tag", TAG_BYTES)):
    HEADER_FIELDS[_name] = (_offset, _offset + _size)
    _offset += _size
assert _offset == HEADER_BYTES

Reason = Literal["missing", "short", "long", "checksum", "mac", "namespace", "key", "magic"]
REASONS: tuple[str, ...] = ("missing", "short", "long", "checksum", "mac", "namespace", "key", "magic")


@dataclass(frozen=True)
class Rejection:
    """Why a stored object was not accepted.

    ``missing``: no object. ``short``/``long``: fewer/more bytes than the
    header declares, or a declared length that is not the namespace's page
    size. ``magic``: not this format or another format version.
    ``namespace``: written under another namespace. ``key``: another page's
    object. ``checksum``: payload bytes changed. ``mac``: the keyed tag does
    not hold (damaged, or not written by a holder of the deployment's secret).
    """

    reason: Reason
    detail: str


def byte_view(payload: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (no numpy); valid
    while ``payload`` lives."""
    nbytes = payload.numel() * payload.element_size()
    raw = (ctypes.c_ubyte * nbytes).from_address(payload.data_ptr())
    return memoryview(raw).cast("B")


def _check_args(name: str, key: object, namespace: object) -> None:
    if not isinstance(namespace, L3Namespace):
        raise TypeError(f"{name}namespace must be an L3Namespace, got {type(namespace).__name__}")
    check_page_key(f"{name}key", key, namespace)


def _payload_view(key: str, namespace: L3Namespace, payload: object) -> memoryview:
    _check_args("", key, namespace)
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.dtype != torch.uint8 or payload.device.type != "cpu" or not payload.is_contiguous():
        raise ValueError(
            f"payload must be a contiguous CPU uint8 tensor, got {payload.dtype} on "
            f"{payload.device} (contiguous={payload.is_contiguous()})"
        )
    if payload.numel() != namespace.page_bytes:
        raise ValueError(
            f"payload must hold namespace.page_bytes={namespace.page_bytes} bytes, "
            f"got {payload.numel()}"
        )
    return byte_view(payload)


def header(key: str, namespace: L3Namespace, payload: torch.Tensor) -> bytes:
    """The header of ``payload``'s object (write it, then the payload's own
    bytes: one gather write, no packed copy). ``payload``: the page's
    bytes, a contiguous CPU uint8 tensor of exactly ``namespace.page_bytes``
    elements (any shape)."""
    view = _payload_view(key, namespace, payload)
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, namespace.digest().encode("ascii"), key.encode("ascii"), len(view))
    return fields + namespace.seal.tag(fields, [view])


def pack(key: str, namespace: L3Namespace, payload: torch.Tensor) -> bytes:
    """The stored object for one page as one bytes object: :func:`header` +
    ``payload`` bytes (for stores that take whole blobs)."""
    head = header(key, namespace, payload)
    return b"".join((head, byte_view(payload)))


def _padded(key: str) -> bytes:
    """The key as the header stores it (struct pads with NUL bytes)."""
    return key.encode("ascii").ljust(KEY_CHARS, bytes(1))


def _length_rejection(actual: int, declared: int, what: str) -> Rejection | None:
    if actual < declared:
        return Rejection("short", f"{actual} payload bytes, {what} {declared}")
    if actual > declared:
        return Rejection("long", f"{actual} payload bytes, {what} {declared}")
    return None


def _check_header(key: str, namespace: L3Namespace, head: memoryview, payload_bytes: int) -> Rejection | bytes:
    """The header's tag if the header and the ``payload_bytes`` that follow
    it are sound, else why not."""
    if len(head) < HEADER_BYTES:
        return Rejection("short", f"{len(head)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, digest, stored_key, declared = _FIELDS.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION:
        return Rejection("magic", f"format {magic!r} v{version}, expected {MAGIC!r} v{FORMAT_VERSION}")
    if digest != namespace.digest().encode("ascii"):
        return Rejection("namespace", f"namespace {digest!r}, expected {namespace.digest()!r}")
    if stored_key != _padded(key):
        return Rejection("key", f"object of {stored_key.rstrip(bytes(1))!r}")
    bad = _length_rejection(payload_bytes, declared, "header declares")
    bad = bad or _length_rejection(declared, namespace.page_bytes, "a page of the namespace has")
    return bytes(head[TAG_OFFSET:HEADER_BYTES]) if bad is None else bad


def _tag_rejection(namespace: L3Namespace) -> Rejection:
    if namespace.seal.authenticates:
        return Rejection("mac", "the keyed BLAKE3 tag does not hold (damaged, or not written with this secret)")
    return Rejection("checksum", "payload XXH3-64 differs from the header's")


def unpack(
    expected_key: str, expected_namespace: L3Namespace, blob: object
) -> Union[torch.Tensor, Rejection]:
    """The page's bytes (a new CPU uint8 tensor of ``page_bytes`` elements)
    if ``blob`` is a sound object of ``expected_key`` in
    ``expected_namespace``; otherwise the :class:`Rejection`.

    ``blob``: bytes-like, or ``None`` for no object. Raises only for bad
    arguments (a key not of the namespace, a blob that is not bytes-like).
    """
    _check_args("expected_", expected_key, expected_namespace)
    if blob is None:
        return Rejection("missing", "no object")
    try:
        view = memoryview(blob).cast("B")  # type: ignore[arg-type]
    except TypeError as err:
        raise TypeError(f"blob must be bytes-like or None, got {type(blob).__name__}") from err
    checked = _check_header(expected_key, expected_namespace, view, len(view) - HEADER_BYTES)
    if isinstance(checked, Rejection):
        return checked
    # Copy first, then checksum the copy: what is returned is exactly what was
    # verified, even if the caller's buffer changes meanwhile.
    payload = bytearray(view[HEADER_BYTES:])
    if not expected_namespace.seal.matches(checked, view[:TAG_OFFSET], [memoryview(payload)]):
        return _tag_rejection(expected_namespace)
    return torch.frombuffer(payload, dtype=torch.uint8)


def check_object(
    expected_key: str, expected_namespace: L3Namespace, head: memoryview,
    payload: memoryview | Sequence[memoryview],
) -> Rejection | None:
    """None if ``head`` + ``payload`` (read into the caller's own buffers, in
    place) are a sound object of ``expected_key``; otherwise why not.
    ``payload``: one buffer, or the runs of a host page in order. The
    caller must not change the buffers before it has used what it checked."""
    _check_args("expected_", expected_key, expected_namespace)
    if len(head) != HEADER_BYTES:
        return Rejection("short", f"{len(head)} header bytes, expected {HEADER_BYTES}")
    parts = [payload] if isinstance(payload, memoryview) else list(payload)
    stored = _check_header(expected_key, expected_namespace, head, sum(map(len, parts)))
    if isinstance(stored, Rejection):
        return stored
    if not expected_namespace.seal.matches(stored, head[:TAG_OFFSET], parts):
        return _tag_rejection(expected_namespace)
    return None
