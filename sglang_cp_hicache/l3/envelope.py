"""The object stored per page: a fixed header, then the page's bytes.

Header (little-endian, 119 bytes, no padding)::

    magic        8 s   b"CPHCL3PG"
    version      u16   FORMAT_VERSION
    namespace   16 s   namespace digest (ASCII hex)
    key         81 s   page key (ASCII)
    payload_len  u64   payload bytes that follow
    checksum     u32   CRC-32 of the payload

Every header byte is either compared exactly with what the reader expects
(magic, version, namespace, key, and the length against both the bytes that
follow and the namespace's page size) or is the checksum, so one flipped bit
anywhere is refused. ``unpack`` never raises on corrupt data and never
returns bytes that fail any check: the caller gets a :class:`Rejection`.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from dataclasses import dataclass
from typing import Literal, Union

import torch

from sglang_cp_hicache.l3.keys import KEY_CHARS, DIGEST_CHARS, L3Namespace, check_page_key

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "HEADER_FIELDS",
    "MAGIC",
    "REASONS",
    "Rejection",
    "pack",
    "unpack",
]

MAGIC = b"CPHCL3PG"
FORMAT_VERSION = 1
_HEADER = struct.Struct(f"<8sH{DIGEST_CHARS}s{KEY_CHARS}sQI")
HEADER_BYTES = _HEADER.size
#: Byte span ``[start, end)`` of each header field (tests flip every bit).
HEADER_FIELDS: dict[str, tuple[int, int]] = {}
_offset = 0
for _name, _size in (("magic", 8), ("version", 2), ("namespace", DIGEST_CHARS),
                     ("key", KEY_CHARS), ("payload_len", 8), ("checksum", 4)):
    HEADER_FIELDS[_name] = (_offset, _offset + _size)
    _offset += _size
assert _offset == HEADER_BYTES

Reason = Literal["missing", "short", "long", "checksum", "namespace", "key", "magic"]
REASONS: tuple[str, ...] = ("missing", "short", "long", "checksum", "namespace", "key", "magic")


@dataclass(frozen=True)
class Rejection:
    """Why a stored object was not accepted.

    ``missing``: no object. ``short``/``long``: fewer/more bytes than the
    header declares, or a declared length that is not the namespace's page
    size. ``magic``: not this format or another format version.
    ``namespace``: written under another namespace. ``key``: another page's
    object. ``checksum``: payload bytes changed.
    """

    reason: Reason
    detail: str


def _checksum(data: memoryview) -> int:
    # CRC-32 (zlib): catches every 1-, 2- and odd-bit error and every burst up
    # to 32 bits, misses random damage with probability 2^-32, runs at ~2.8 GB/s
    # here (blake2b-128: 0.6 GB/s, sha256: 1.0 GB/s) and releases the GIL on
    # large buffers. A page is MBs and is checked on every restore, so speed
    # decides; identity (another page, another model) is the header's exact
    # key and namespace match, not the checksum's job.
    return zlib.crc32(data)


def _byte_view(payload: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU uint8 tensor (no numpy);
    valid while ``payload`` lives."""
    raw = (ctypes.c_ubyte * payload.numel()).from_address(payload.data_ptr())
    return memoryview(raw).cast("B")


def _check_args(name: str, key: object, namespace: object) -> None:
    if not isinstance(namespace, L3Namespace):
        raise TypeError(f"{name}namespace must be an L3Namespace, got {type(namespace).__name__}")
    check_page_key(f"{name}key", key, namespace)


def pack(key: str, namespace: L3Namespace, payload: torch.Tensor) -> bytes:
    """The stored object for one page: header + ``payload`` bytes.

    ``payload``: the page's bytes, a contiguous CPU uint8 tensor of exactly
    ``namespace.page_bytes`` elements (any shape).
    """
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
    view = _byte_view(payload)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, namespace.digest().encode("ascii"), key.encode("ascii"),
        len(view), _checksum(view),
    )
    return b"".join((header, view))


def _length_rejection(actual: int, declared: int, what: str) -> Rejection | None:
    if actual < declared:
        return Rejection("short", f"{actual} payload bytes, {what} {declared}")
    if actual > declared:
        return Rejection("long", f"{actual} payload bytes, {what} {declared}")
    return None


def _check_header(key: str, namespace: L3Namespace, view: memoryview) -> Rejection | int:
    """The header's checksum if the header and length are sound, else why not."""
    if len(view) < HEADER_BYTES:
        return Rejection("short", f"{len(view)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, digest, stored_key, declared, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION:
        return Rejection("magic", f"format {magic!r} v{version}, expected {MAGIC!r} v{FORMAT_VERSION}")
    if digest != namespace.digest().encode("ascii"):
        return Rejection("namespace", f"namespace {digest!r}, expected {namespace.digest()!r}")
    if stored_key != key.encode("ascii"):
        return Rejection("key", f"object of {stored_key!r}")
    bad = _length_rejection(len(view) - HEADER_BYTES, declared, "header declares")
    bad = bad or _length_rejection(declared, namespace.page_bytes, "a page of the namespace has")
    return checksum if bad is None else bad


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
    checked = _check_header(expected_key, expected_namespace, view)
    if isinstance(checked, Rejection):
        return checked
    # Copy first, then checksum the copy: what is returned is exactly what was
    # verified, even if the caller's buffer changes meanwhile.
    payload = bytearray(view[HEADER_BYTES:])
    if _checksum(memoryview(payload)) != checked:
        return Rejection("checksum", f"payload CRC-32 differs from the header's {checked:#010x}")
    return torch.frombuffer(payload, dtype=torch.uint8)
