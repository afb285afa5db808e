"""Start-up agreement of the CP ranks: one all-gather when a cache is built.

Every rank decides from identical state without asking the others (which
host nodes to evict, which owner lane a page takes, which copies run), so
ranks that were started with different settings would diverge silently --
different trees, wrong pages, or a hang in a later collective. One
all-gather of each rank's view, checked the same way on every rank, turns
that into an error at start-up that names the disagreeing rank and value,
raised on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch.distributed as dist

__all__ = [
    "COPY_BACKEND_KEY", "COPY_PATH_KEY", "CpAgreementError", "HOST_LAYOUT_KEY", "HOST_POOL_SLOTS_KEY", "L3_KEY",
    "PAGE_SIZE_KEY", "RankView", "check_agreement", "gather_and_check",
]

# The keys of a rank's view that both releases send, one name per value (an
# operator reads the same words in a refusal whichever release refused).
#: Tokens per KV page.
PAGE_SIZE_KEY = "page_size"
#: SGLang's host memory layout string (``layer_first``, ``page_first`` ...).
HOST_LAYOUT_KEY = "host_layout"
#: Host slots (tokens) of this rank's host KV pool.
HOST_POOL_SLOTS_KEY = "host_pool_slots"
#: The copy kernels' backend on the pool's device (``kernels.transfer.select_backend``).
COPY_BACKEND_KEY = "copy_backend"
#: ``library`` (this library's copies) or ``upstream`` (SGLang's own).
COPY_PATH_KEY = "copy_path"
#: ``off``, or the L3 tier's namespaces (or why this rank's L3 is unusable).
L3_KEY = "l3"


class CpAgreementError(ValueError):
    """The CP ranks were started with settings that differ."""


@dataclass(frozen=True)
class RankView:
    """What one CP rank was started with. ``values`` must be equal on every
    rank (cp_size, page size, host layout, policies, pool sizes ...)."""

    cp_rank: int
    cp_size: int
    values: dict[str, Any] = field(default_factory=dict)


def check_agreement(views: Sequence[RankView], *, whole_group: bool = True) -> None:
    """Raise :class:`CpAgreementError` unless every view has the same
    ``cp_size`` and ``values`` and the ``cp_rank``s are distinct, in
    0..N-1 and (``whole_group``) all N present. The first view is the
    reference the others are named against; of several values that differ,
    the page size is named, else the first key in sorted order."""
    if not views:
        raise CpAgreementError("no CP rank took part in the start-up agreement")
    ref = views[0]
    for i, v in enumerate(views):
        if v.cp_size != ref.cp_size:
            raise CpAgreementError(
                f"CP ranks disagree on cp_size: group rank {i} (cp_rank {v.cp_rank}) has "
                f"{v.cp_size}, group rank 0 (cp_rank {ref.cp_rank}) has {ref.cp_size}"
            )
        # The page size first: sizes in slots follow from it, so a rank on
        # another page size is named by its cause.
        for key in sorted(set(ref.values) | set(v.values), key=lambda k: (k != PAGE_SIZE_KEY, k)):
            mine, theirs = v.values.get(key), ref.values.get(key)
            if mine != theirs:
                raise CpAgreementError(
                    f"CP ranks disagree on {key}: cp_rank {v.cp_rank} has {mine!r}, "
                    f"cp_rank {ref.cp_rank} has {theirs!r}; start every rank with the same {key}"
                )
    if whole_group and len(views) != ref.cp_size:
        raise CpAgreementError(
            f"the CP group has {len(views)} ranks but cp_size is {ref.cp_size}"
        )
    seen: dict[int, int] = {}
    for i, v in enumerate(views):
        if not 0 <= v.cp_rank < ref.cp_size:
            raise CpAgreementError(f"group rank {i} has cp_rank {v.cp_rank}, outside 0..{ref.cp_size - 1}")
        if v.cp_rank in seen:
            raise CpAgreementError(
                f"cp_rank {v.cp_rank} is claimed by group ranks {seen[v.cp_rank]} and {i}; "
                f"each rank of the CP group needs its own cp_rank in 0..{ref.cp_size - 1}"
            )
        seen[v.cp_rank] = i


def gather_and_check(
    view: RankView,
    group: Optional[Any],
    *,
    all_gather: Optional[Callable[[list, Any, Any], None]] = None,
    hints: Optional[Mapping[str, str]] = None,
) -> list[RankView]:
    """All-gather ``view`` over ``group`` (every rank calls this, once, when
    its cache is built) and check the result. ``all_gather`` stands in for
    ``torch.distributed.all_gather_object`` (tests with a bare process group). Without a group (no process
    group: a lone rank, e.g. in a unit test) only ``view`` itself is checked.
    ``hints``: key -> what to tell the operator when the ranks disagree on
    that key (appended to the error, after ``"; "``)."""
    try:
        if group is None:
            check_agreement([view], whole_group=False)
            return [view]
        gather = all_gather or dist.all_gather_object
        out: list = [None] * (group.size() if all_gather else dist.get_world_size(group))
        gather(out, asdict(view), group=group)
        views = [RankView(**v) for v in out]
        check_agreement(views)
        return views
    except CpAgreementError as exc:
        hint = next((h for key, h in (hints or {}).items() if f"disagree on {key}:" in str(exc)), None)
        if hint is None:
            raise
        raise CpAgreementError(f"{exc}; {hint}") from exc
