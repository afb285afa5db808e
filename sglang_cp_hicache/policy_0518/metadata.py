"""Per-node CP HiCache metadata: which logical positions this rank backed up
and where they live in this rank's host pool.

``TreeNode.value`` keeps the node's full logical device locs; ``host_len``
keeps the node's logical length on host; this object keeps the rank-local part.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Optional

import torch

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.validation import check_cpu_int64, check_int

__all__ = ["CpHiCacheNodeMetadata"]


@dataclass
class CpHiCacheNodeMetadata:
    """Rank-local host state of one radix node under CP shared KV.

    Attributes:
        logical_len: tokens in the node (identical on every rank).
        owned_positions: strictly increasing positions in ``[0, logical_len)``
            whose pages this rank owned at backup time; CPU int64.
        host_indices: this rank's host slots for those positions, same order
            and length, no slot twice; CPU int64.
        token_owners: optional owner rank of every position (length
            ``logical_len``), identical on every rank. It lets every rank
            reason about every other rank's host usage (consistent host
            eviction) and re-allocate pages with the same owners on load-back.

    ``placement`` (keyword only, not stored) is the rank's placement when the
    caller knows it; with ``token_owners`` it adds the cross checks: owners
    in ``[0, cp_size)``, one owner per page (a node starts on a page
    boundary), and ``owned_positions`` exactly the positions this rank owns.
    """

    logical_len: int
    owned_positions: torch.Tensor
    host_indices: torch.Tensor
    token_owners: Optional[torch.Tensor] = None
    _: KW_ONLY
    placement: InitVar[Optional[CpPlacement]] = None

    def __post_init__(self, placement: Optional[CpPlacement]) -> None:
        check_int("logical_len", self.logical_len, 0)
        if placement is not None and not isinstance(placement, CpPlacement):
            raise TypeError(f"placement must be a CpPlacement, got {type(placement).__name__}")
        positions = check_cpu_int64("owned_positions", self.owned_positions)
        hosts = check_cpu_int64("host_indices", self.host_indices)
        owners = None if self.token_owners is None else check_cpu_int64("token_owners", self.token_owners)
        if positions.numel() != hosts.numel():
            raise ValueError(
                "owned_positions and host_indices must have the same length, got "
                f"{positions.numel()} and {hosts.numel()}"
            )
        if positions.numel() > 0:
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= self.logical_len:
                raise ValueError(
                    f"owned_positions must be in [0, logical_len) = [0, {self.logical_len}), "
                    f"got min {lo} max {hi}"
                )
            if bool((positions[1:] <= positions[:-1]).any()):
                raise ValueError("owned_positions must be sorted strictly increasing (no duplicates)")
            if int(hosts.min()) < 0:
                raise ValueError("host_indices must be non-negative")
            # Two positions in one slot: loading back would restore one of them wrong.
            if torch.unique(hosts).numel() != hosts.numel():
                raise ValueError("host_indices must not hold a host slot twice")
        if owners is not None:
            _check_owners(owners, self.logical_len, positions, placement)
        self.owned_positions, self.host_indices, self.token_owners = positions, hosts, owners

    @classmethod
    def _trusted(
        cls,
        logical_len: int,
        owned_positions: torch.Tensor,
        host_indices: torch.Tensor,
        token_owners: Optional[torch.Tensor],
    ) -> "CpHiCacheNodeMetadata":
        """Build from pieces already known valid (split results): skips checks."""
        obj = object.__new__(cls)
        obj.logical_len = logical_len
        obj.owned_positions = owned_positions
        obj.host_indices = host_indices
        obj.token_owners = token_owners
        return obj

    @classmethod
    def empty(cls, logical_len: int) -> "CpHiCacheNodeMetadata":
        none = torch.empty((0,), dtype=torch.int64)
        return cls(logical_len, none, none.clone())

    @property
    def num_host_slots(self) -> int:
        """Physical host slots this rank holds for the node."""
        return int(self.host_indices.numel())

    def owner_slot_counts(self, cp_size: int) -> list[int]:
        """Host slots each of the ``cp_size`` ranks holds for this node
        (needs ``token_owners``): exactly ``cp_size`` entries."""
        check_int("cp_size", cp_size, 1)
        if self.token_owners is None:
            raise ValueError("owner_slot_counts needs token_owners")
        counts = torch.bincount(self.token_owners, minlength=cp_size)
        if counts.numel() > cp_size:  # bincount grows past the largest owner
            raise ValueError(
                f"cp_size={cp_size} but token_owners names rank {counts.numel() - 1}"
            )
        return counts.tolist()

    def split(
        self, split_len: int
    ) -> tuple["CpHiCacheNodeMetadata", "CpHiCacheNodeMetadata"]:
        """Split at ``split_len``: (prefix part, suffix part rebased to 0)."""
        check_int("split_len", split_len, 0, self.logical_len)
        # Positions are sorted, so the cut is one binary search, no mask.
        cut = int(torch.searchsorted(self.owned_positions, split_len))
        owners = self.token_owners
        return (
            CpHiCacheNodeMetadata._trusted(
                split_len,
                self.owned_positions[:cut],
                self.host_indices[:cut],
                None if owners is None else owners[:split_len],
            ),
            CpHiCacheNodeMetadata._trusted(
                self.logical_len - split_len,
                self.owned_positions[cut:] - split_len,
                self.host_indices[cut:],
                None if owners is None else owners[split_len:],
            ),
        )


def _check_owners(
    owners: torch.Tensor,
    logical_len: int,
    positions: torch.Tensor,
    placement: Optional[CpPlacement],
) -> None:
    if owners.numel() != logical_len:
        raise ValueError(
            f"token_owners must have logical_len={logical_len} entries, got {owners.numel()}"
        )
    if owners.numel() == 0:
        return
    if int(owners.min()) < 0:
        raise ValueError("token_owners must be non-negative")
    if placement is None:
        return
    if int(owners.max()) >= placement.cp_size:
        raise ValueError(f"token_owners must be in [0, cp_size={placement.cp_size}), got {int(owners.max())}")
    P = placement.page_size
    page_first = torch.div(torch.arange(logical_len), P, rounding_mode="floor") * P
    if not torch.equal(owners, owners[page_first]):
        raise ValueError(f"token_owners must be constant within each page of page_size={P}")
    mine = torch.nonzero(owners == placement.cp_rank).reshape(-1)
    if not torch.equal(mine, positions):
        raise ValueError(
            f"owned_positions must be exactly the positions whose token_owners entry is "
            f"cp_rank={placement.cp_rank} ({mine.numel()} of them), got {positions.numel()} "
            "positions that differ"
        )
