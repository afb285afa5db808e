"""One rank's L3 work on a chain: store its own pages, fetch and verify its
own pages, and report its local usable prefix for the group's MIN.

This is what an adapter calls from its backup and prefetch paths; it knows
nothing of SGLang, only a :class:`PageStore`, a namespace and a plan.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, Rejection, byte_view, check_object, header, pack, unpack
from sglang_cp_hicache.l3.keys import L3Namespace, check_page_key
from sglang_cp_hicache.l3.plan import L3ReadPlan, L3WritePlan
from sglang_cp_hicache.l3.store import PageStore, SizeMismatch
from sglang_cp_hicache.validation import check_int

__all__ = [
    "L3FetchResult", "PutOutcome", "checked_objects", "fetch_owned", "object_bytes", "read_verified",
    "size_rejection", "store_owned", "store_verified",
]

logger = logging.getLogger(__name__)


class PutOutcome(str, enum.Enum):
    """What :func:`store_owned` did with one page's object."""

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


def _check_common(store: object, namespace: object) -> None:
    if not isinstance(store, PageStore):
        raise TypeError(f"store must be a PageStore, got {type(store).__name__}")
    if not isinstance(namespace, L3Namespace):
        raise TypeError(f"namespace must be an L3Namespace, got {type(namespace).__name__}")


def checked_objects(
    store: PageStore, namespace: L3Namespace, keys: Sequence[str]
) -> list[torch.Tensor | Rejection]:
    """Each key's page bytes if its object is sound, else why not; an object
    of the wrong size is refused without reading it."""
    if not keys:
        return []
    blobs = store.get(list(keys), [object_bytes(namespace)] * len(keys))
    if len(blobs) != len(keys):
        raise RuntimeError(f"store returned {len(blobs)} objects for {len(keys)} keys")
    out: list[torch.Tensor | Rejection] = []
    for key, blob in zip(keys, blobs):
        if isinstance(blob, SizeMismatch):
            out.append(size_rejection(blob, object_bytes(namespace)))
        else:
            out.append(unpack(key, namespace, blob))
    return out


def read_verified(
    store: PageStore, namespace: L3Namespace, key: str, head: memoryview, payload: memoryview
) -> Rejection | None:
    """Read ``key``'s object into the caller's ``head`` (``HEADER_BYTES``) and
    ``payload`` (a page) buffers and verify it there; None if it is sound.
    A store with ``read_into`` fills them in one scatter read (no copy);
    another store's blob is copied in. Never raises on a bad object."""
    want = object_bytes(namespace)
    read_into = getattr(store, "read_into", None)
    if read_into is not None:
        got = read_into(key, want, [head, payload])
    else:
        blob = store.get([key], [want])[0]
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
    store: PageStore, namespace: L3Namespace, key: str, payload: torch.Tensor, scratch: tuple[memoryview, memoryview]
) -> PutOutcome:
    """Store one page's object, unless a sound one is there already: an
    object under the key is read into ``scratch`` (header and page buffers)
    and verified first; a damaged one is replaced. The header and the
    payload's own bytes go out in one gather write where the store takes
    one (``write_from``), else as one blob."""
    head = header(key, namespace, payload)  # checks the payload before any I/O
    present = bool(store.exists([key])[0])
    if present and read_verified(store, namespace, key, *scratch) is None:
        return PutOutcome.KEPT
    write_from = getattr(store, "write_from", None)
    if write_from is not None:
        ok = write_from(key, [memoryview(head), byte_view(payload)])
    else:
        ok = store.put([key], [b"".join((head, byte_view(payload)))])[0]
    if not ok:
        logger.warning("L3 write failed: %s", key)
        return PutOutcome.FAILED
    return PutOutcome.REPAIRED if present else PutOutcome.WRITTEN


def store_owned(
    store: PageStore, namespace: L3Namespace, plan: L3WritePlan, payloads: Sequence[torch.Tensor]
) -> list[PutOutcome]:
    """Store this rank's pages of a chain; one outcome per plan page.

    ``payloads[j]``: the bytes of page ``plan.page_indices[j]`` (see
    ``envelope.pack``). Every page is packed (and so checked) before the
    first is written: bad input writes nothing. An object already stored
    under a page's key is read and verified first: a sound one is kept, a
    damaged one (a flipped bit, a zero-filled file after a crash, another
    page's or namespace's object) is replaced.
    """
    _check_common(store, namespace)
    if not isinstance(plan, L3WritePlan):
        raise TypeError(f"plan must be an L3WritePlan, got {type(plan).__name__}")
    if len(payloads) != len(plan.keys):
        raise ValueError(f"payloads must have one entry per planned page ({len(plan.keys)}), got {len(payloads)}")
    blobs = [pack(key, namespace, payload) for key, payload in zip(plan.keys, payloads)]
    if not blobs:
        return []
    keys = list(plan.keys)
    present = [bool(p) for p in store.exists(keys)]
    found = [i for i, here in enumerate(present) if here]
    sound = {i for i, obj in zip(found, checked_objects(store, namespace, [keys[i] for i in found]))
             if isinstance(obj, torch.Tensor)}
    todo = [i for i in range(len(keys)) if i not in sound]
    outcomes = [PutOutcome.KEPT] * len(keys)
    if todo:
        results = store.put([keys[i] for i in todo], [blobs[i] for i in todo])
        for i, ok in zip(todo, results):
            if not ok:
                outcomes[i] = PutOutcome.FAILED
                logger.warning("L3 write failed: %s", keys[i])
            else:
                outcomes[i] = PutOutcome.REPAIRED if present[i] else PutOutcome.WRITTEN
    return outcomes


@dataclass(frozen=True)
class L3FetchResult:
    """What one rank fetched for a prefetch.

    ``payloads[j]``/``rejections[j]``: page ``plan.page_indices[j]``: its
    verified bytes, or why it was refused. ``usable_pages``: this rank's
    local usable prefix (feed it to the group's MIN); payloads at or past it
    are dropped, since no rank may use them.
    """

    plan: L3ReadPlan
    payloads: tuple[Optional[torch.Tensor], ...]
    rejections: tuple[Optional[Rejection], ...]
    usable_pages: int

    def restorable(self, agreed_pages: int) -> list[tuple[int, torch.Tensor]]:
        """``(chain index, bytes)`` of this rank's pages below the group's
        agreed prefix: the only pages it may restore."""
        check_int("agreed_pages", agreed_pages, 0, self.usable_pages)
        return [
            (index, page)
            for index, page in zip(self.plan.page_indices, self.payloads)
            if index < agreed_pages and page is not None
        ]


def fetch_owned(store: PageStore, namespace: L3Namespace, plan: L3ReadPlan) -> L3FetchResult:
    """Fetch and verify this rank's pages of a prefetch."""
    _check_common(store, namespace)
    if not isinstance(plan, L3ReadPlan):
        raise TypeError(f"plan must be an L3ReadPlan, got {type(plan).__name__}")
    for i, key in enumerate(plan.keys):  # before any I/O
        check_page_key(f"plan.keys[{i}]", key, namespace)
    checked = checked_objects(store, namespace, list(plan.keys))
    rejections = tuple(c if isinstance(c, Rejection) else None for c in checked)
    for key, bad in zip(plan.keys, rejections):
        if bad is not None and bad.reason != "missing":
            logger.warning("L3 object %s rejected (%s): %s", key, bad.reason, bad.detail)
    ok = [bad is None for bad in rejections]
    usable = local_usable_pages(plan.page_indices, ok, plan.num_pages)
    payloads = tuple(
        c if isinstance(c, torch.Tensor) and index < usable else None
        for c, index in zip(checked, plan.page_indices)
    )
    return L3FetchResult(plan, payloads, rejections, usable)
