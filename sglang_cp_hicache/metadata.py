"""Per-node CP HiCache metadata: which logical positions this rank backed up
and where they live in this rank's host pool.

``TreeNode.value`` keeps the node's full logical device locs; ``host_len``
keeps the node's logical length on host; this object keeps the rank-local part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["CpHiCacheNodeMetadata"]


def _as_cpu_int64(name: str, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    return value.to(device="cpu", dtype=torch.int64)


@dataclass
class CpHiCacheNodeMetadata:
    """Rank-local host state of one radix node under CP shared KV.

    Attributes:
        logical_len: tokens in the node (identical on every rank).
        owned_positions: strictly increasing positions in ``[0, logical_len)``
            whose pages this rank owned at backup time; CPU int64.
        host_indices: this rank's host slots for those positions, same order
            and length; CPU int64.
        token_owners: optional owner rank of every position (length
            ``logical_len``), identical on every rank. It lets every rank
            reason about every other rank's host usage (consistent host
            eviction) and re-allocate pages with the same owners on load-back.
    """

    logical_len: int
    owned_positions: torch.Tensor
    host_indices: torch.Tensor
    token_owners: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if isinstance(self.logical_len, bool) or not isinstance(self.logical_len, int):
            raise TypeError(f"logical_len must be an int, got {type(self.logical_len).__name__}")
        if self.logical_len < 0:
            raise ValueError(f"logical_len must be non-negative, got {self.logical_len}")
        self.owned_positions = _as_cpu_int64("owned_positions", self.owned_positions)
        self.host_indices = _as_cpu_int64("host_indices", self.host_indices)
        if self.owned_positions.numel() != self.host_indices.numel():
            raise ValueError(
                "owned_positions and host_indices must have the same length, got "
                f"{self.owned_positions.numel()} and {self.host_indices.numel()}"
            )
        if self.owned_positions.numel() > 0:
            lo = int(self.owned_positions.min())
            hi = int(self.owned_positions.max())
            if lo < 0 or hi >= self.logical_len:
                raise ValueError(
                    f"owned_positions must be in [0, logical_len) = [0, {self.logical_len}), "
                    f"got min {lo} max {hi}"
                )
            if bool((self.owned_positions[1:] <= self.owned_positions[:-1]).any()):
                raise ValueError("owned_positions must be sorted strictly increasing (no duplicates)")
            if int(self.host_indices.min()) < 0:
                raise ValueError("host_indices must be non-negative")
        if self.token_owners is not None:
            owners = _as_cpu_int64("token_owners", self.token_owners)
            if owners.numel() != self.logical_len:
                raise ValueError(
                    f"token_owners must have logical_len={self.logical_len} entries, "
                    f"got {owners.numel()}"
                )
            if owners.numel() > 0 and int(owners.min()) < 0:
                raise ValueError("token_owners must be non-negative")
            self.token_owners = owners

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
        """Host slots every rank holds for this node (needs ``token_owners``)."""
        if self.token_owners is None:
            raise ValueError("owner_slot_counts needs token_owners")
        return torch.bincount(self.token_owners, minlength=cp_size).tolist()

    def split(
        self, split_len: int
    ) -> tuple["CpHiCacheNodeMetadata", "CpHiCacheNodeMetadata"]:
        """Split at ``split_len``: (prefix part, suffix part rebased to 0)."""
        if isinstance(split_len, bool) or not isinstance(split_len, int):
            raise TypeError(f"split_len must be an int, got {type(split_len).__name__}")
        if split_len < 0 or split_len > self.logical_len:
            raise ValueError(
                f"split_len must be in [0, {self.logical_len}], got {split_len}"
            )
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
