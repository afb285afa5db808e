"""One page's object in a :class:`PageStore`: stored unless a sound one is
there already, and read and verified into the caller's buffers.

The tier calls these for every own page it writes or reads; they know
nothing of SGLang, only a store (its capabilities found once) and a
namespace.
"""

from __future__ import annotations

import enum
import logging

import torch

from sglang_cp_hicache.l3.envelope import HEADER_BYTES, Rejection, byte_view, check_object, header
from sglang_cp_hicache.l3.keys import L3Namespace
from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.store import SizeMismatch

__all__ = ["PutOutcome", "object_bytes", "read_verified", "size_rejection", "store_verified"]

logger = logging.getLogger(__name__)


class PutOutcome(str, enum.Enum):
    """What :func:`store_verified` did with one page's object."""

    WRITTEN = "written"  # no object was there: stored
    KEPT = "kept"  # a sound object was there (header, length, checksum): left alone
    REPAIRED = "repaired"  # a damaged or foreign object was there: replaced
    FAILED = "failed"  # the put failed: the page is absent, or a damaged object stays

    @property
    def in_l3(self) -> bool:
        return self is not PutOutcome.FAILED

    def __bool__(self) -> bool:  # truthy: the page's object is in L3 and sound
        return self.in_l3


def object_bytes(namespace: L3Namespace) -> int:
    """The exact size of one stored object of ``namespace``."""
    return HEADER_BYTES + namespace.page_bytes


def size_rejection(stored: SizeMismatch | int, want: int) -> Rejection:
    """Why an object of ``stored`` bytes is refused where ``want`` are a page's object."""
    got = stored.stored_bytes if isinstance(stored, SizeMismatch) else stored
    return Rejection("short" if got < want else "long", f"object of {got} bytes, a page's has {want}")


def read_verified(
    caps: StoreCapabilities, namespace: L3Namespace, key: str, head: memoryview, payload: memoryview
) -> Rejection | None:
    """Read ``key``'s object into the caller's ``head`` (``HEADER_BYTES``) and
    ``payload`` (a page) buffers and verify it there; None if it is sound.
    A store that reads into buffers fills them in one scatter read (no
    copy); another store's blob is copied in. Never raises on a bad object."""
    want = object_bytes(namespace)
    if caps.reads_into is not None:
        got = caps.reads_into.read_into(key, want, [head, payload])
    else:
        blob = caps.store.get([key], [want])[0]
        if isinstance(blob, (bytes, bytearray, memoryview)) and len(blob) == want:
            view = memoryview(blob).cast("B")
            head[:] = view[:HEADER_BYTES]
            payload[:] = view[HEADER_BYTES:]
            got = want
        else:
            got = blob if blob is None or isinstance(blob, SizeMismatch) else SizeMismatch(len(blob))
    if got is None:
        return Rejection("missing", "no object")
    if isinstance(got, SizeMismatch):
        return size_rejection(got, want)
    return check_object(key, namespace, head, payload)


def store_verified(
    caps: StoreCapabilities, namespace: L3Namespace, key: str, payload: torch.Tensor,
    scratch: tuple[memoryview, memoryview],
) -> PutOutcome:
    """Store one page's object, unless a sound one is there already: an
    object under the key is read into ``scratch`` (header and page buffers)
    and verified first; a damaged one is replaced. The header and the
    payload's own bytes go out in one gather write where the store takes
    one (:class:`~.capabilities.WritesFrom`), else as one blob."""
    head = header(key, namespace, payload)  # checks the payload before any I/O
    present = bool(caps.store.exists([key])[0])
    if present and read_verified(caps, namespace, key, *scratch) is None:
        return PutOutcome.KEPT
    if caps.writes_from is not None:
        ok = caps.writes_from.write_from(key, [memoryview(head), byte_view(payload)])
    else:
        ok = caps.store.put([key], [b"".join((head, byte_view(payload)))])[0]
    if not ok:
        logger.warning("L3 write failed: %s", key)
        return PutOutcome.FAILED
    return PutOutcome.REPAIRED if present else PutOutcome.WRITTEN
