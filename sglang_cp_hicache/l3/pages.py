"""One rank's L3 work on a chain: store its own pages, fetch and verify its
own pages, and report its local usable prefix for the group's MIN.

This is what an adapter calls from its backup and prefetch paths; it knows
nothing of SGLang, only a :class:`PageStore`, a namespace and a plan.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.envelope import Rejection, pack, unpack
from sglang_cp_hicache.l3.keys import L3Namespace, check_page_key
from sglang_cp_hicache.l3.plan import L3ReadPlan, L3WritePlan
from sglang_cp_hicache.l3.store import PageStore
from sglang_cp_hicache.validation import check_int

__all__ = ["L3FetchResult", "fetch_owned", "store_owned"]

logger = logging.getLogger(__name__)


def _check_common(store: object, namespace: object) -> None:
    if not isinstance(store, PageStore):
        raise TypeError(f"store must be a PageStore, got {type(store).__name__}")
    if not isinstance(namespace, L3Namespace):
        raise TypeError(f"namespace must be an L3Namespace, got {type(namespace).__name__}")


def store_owned(
    store: PageStore, namespace: L3Namespace, plan: L3WritePlan, payloads: Sequence[torch.Tensor]
) -> list[bool]:
    """Store this rank's pages of a chain; one result per plan page.

    ``payloads[j]``: the bytes of page ``plan.page_indices[j]`` (see
    ``envelope.pack``). Every page is packed (and so checked) before the
    first is written: bad input writes nothing.
    """
    _check_common(store, namespace)
    if not isinstance(plan, L3WritePlan):
        raise TypeError(f"plan must be an L3WritePlan, got {type(plan).__name__}")
    if len(payloads) != len(plan.keys):
        raise ValueError(f"payloads must have one entry per planned page ({len(plan.keys)}), got {len(payloads)}")
    blobs = [pack(key, namespace, payload) for key, payload in zip(plan.keys, payloads)]
    if not blobs:
        return []
    results = [bool(ok) for ok in store.put(list(plan.keys), blobs)]
    for key, ok in zip(plan.keys, results):
        if not ok:
            logger.warning("L3 write failed: %s", key)
    return results


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
    blobs = store.get(list(plan.keys)) if plan.keys else []
    if len(blobs) != len(plan.keys):
        raise RuntimeError(f"store returned {len(blobs)} objects for {len(plan.keys)} keys")
    checked = [unpack(key, namespace, blob) for key, blob in zip(plan.keys, blobs)]
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
