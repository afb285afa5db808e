"""Argument checks shared by the core modules.

Each raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError``
(wrong value, shape or range) with the argument's name first, and never
changes anything: callers check before they touch state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_1d_int_tensor", "check_cpu_int64", "check_int", "check_int_list", "check_int_tensor",
]


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """A real ``int`` (``bool`` is refused) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_int_list(
    name: str, value: object, *, length: int | None = None, minimum: int | None = None
) -> list[int]:
    """A list or tuple of real ``int`` s, each ``>= minimum``, returned as a new list.

    ``length``: the exact number of entries (one per CP rank, say); without
    it a wrong-length list would be silently truncated by ``zip``.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(value)}")
    return [check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]


def check_int_tensor(name: str, value: object) -> torch.Tensor:
    """A tensor of an integer dtype (any shape, any device)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value


def check_1d_int_tensor(name: str, value: object) -> torch.Tensor:
    """A 1-D integer tensor; its values are never read (it may live on a GPU)."""
    value = check_int_tensor(name, value)
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    return value


def check_cpu_int64(name: str, value: object) -> torch.Tensor:
    """A 1-D integer tensor, returned as CPU int64 (a copy only when needed).

    Only for tensors that already live on the CPU or whose values the caller
    is entitled to read (metadata, never device-side locs on a hot path).
    """
    return check_1d_int_tensor(name, value).to(device="cpu", dtype=torch.int64)
