"""Read one stored object into a host page, verified, and at the speed of
the read alone where the page cache allows it.

An L3 job writes host rows only inside its ``publish`` (the job's lock;
once the job is cancelled it raises and writes nothing), so that the rows of
a lookup given up at its deadline can be handed out again at once. A read
that can wait on storage (an NFS server that went away) must therefore never
run inside it. Two ways in, tried in this order:

* **straight into the host rows**: the object is opened outside the lock
  (opening can wait); inside it, one scatter read of the header and the
  page's runs in the host pool (``preadv2(RWF_NOWAIT)``: from the page
  cache alone, it never waits on the device or the network) and the check
  of the header and checksum there. No copy. Where a byte is not cached,
  the file system cannot tell, the store is not a file store or the pool
  does not hand out its rows, it falls through to:
* **through a staging buffer**: the read (which may wait) fills this
  thread's staging buffers outside the lock, the object is checked there,
  and only a sound page is copied into the host rows inside the lock.

Host rows a failed read wrote hold no page of any node: the caller counts
the page as missing or refused, so its lookup's usable prefix ends before
it and the rows go back unused.
"""

from __future__ import annotations

from typing import Callable

import torch

from sglang_cp_hicache.l3.envelope import Rejection, byte_view, check_object
from sglang_cp_hicache.l3.host_copy import HostPageRuns, write_host_page
from sglang_cp_hicache.l3.keys import L3Namespace
from sglang_cp_hicache.l3.pages import object_bytes, read_verified, size_rejection
from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.store import OpenObject

__all__ = ["Publish", "read_into_host"]

#: An L3 job's publish: runs the write it is given under the job's lock,
#: or raises once the job is cancelled.
Publish = Callable[[Callable[[], None]], None]


def read_into_host(
    caps: StoreCapabilities, namespace: L3Namespace, key: str, rows: HostPageRuns, row: int,
    head: memoryview, staging: torch.Tensor, publish: Publish,
) -> Rejection | None:
    """Read ``key``'s object into host row ``row`` of ``rows``' pool and
    verify it; None if the page there is sound. ``head`` (``HEADER_BYTES``),
    ``staging`` (one page, a CPU uint8 tensor): this thread's buffers. Never
    raises on a bad object; raises what ``publish`` raises once the job is
    cancelled."""
    opener = caps.opens_objects
    runs = rows.runs(row, namespace.page_bytes) if opener is not None else None
    if opener is None or runs is None:
        bad = read_verified(caps, namespace, key, head, byte_view(staging))
    else:
        want = object_bytes(namespace)
        opened = opener.open_object(key, want)  # may wait on storage: no lock held
        if not isinstance(opened, OpenObject):
            return Rejection("missing", "no object") if opened is None else size_rejection(opened, want)
        with opened:
            direct: list[Rejection | None] = []

            def read_in_place() -> None:
                if opened.read([head, *runs], cached_only=True):
                    direct.append(check_object(key, namespace, head, runs))

            publish(read_in_place)
            if direct:
                return direct[0]
            staging_view = byte_view(staging)
            got = opened.read([head, staging_view])  # not all cached: may wait, so outside the lock
        if got is None:
            return Rejection("missing", "unreadable")
        bad = check_object(key, namespace, head, staging_view) if got == want else size_rejection(got, want)
    if bad is None:
        publish(lambda: write_host_page(rows.host, rows.buffer, row, staging))
    return bad
