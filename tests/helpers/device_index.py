"""Device index tensors that raise on any host read (a GPU sync).

Every device-side index tensor the sharded allocator hands out (and so every
node value, match result and load-back result derived from it) is wrapped as
a :class:`DeviceIndex`: any host read of its values -- ``.cpu()``,
``.to("cpu")``, ``.tolist()``, ``.item()``, ``int()``, ``bool()``,
``nonzero``, ``unique``, boolean-mask indexing, ``masked_select``,
``bincount``, ``torch.equal``, ``repr`` -- raises :class:`HostRead`. Only
"device work" may read them: the copy kernels and a harness's own content
fill and check (the forward pass's job on a server), inside
:func:`device_side`. Shapes (``len``, ``numel``) are host metadata and fine.

Both releases' no-sync tests use it; on a GPU the same code runs under
``torch.cuda.set_sync_debug_mode("error")``, which :func:`device_side` sets
back to ``default`` while device work runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

__all__ = ["DeviceIndex", "HostRead", "device_side", "unwrap", "wrap"]

_state = threading.local()


class HostRead(AssertionError):
    """A device-side index tensor was read on the host (a GPU sync)."""


@contextlib.contextmanager
def device_side() -> Iterator[None]:
    """Code inside runs "on the device": it may read DeviceIndex values (and,
    on a GPU, synchronise)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    cuda_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if cuda_mode:
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        _state.depth = depth
        if cuda_mode:
            torch.cuda.set_sync_debug_mode(cuda_mode)


_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.cpu,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.unique_consecutive,
    torch.Tensor.masked_select, torch.masked_select, torch.Tensor.bincount, torch.bincount,
    torch.equal, torch.Tensor.equal, torch.Tensor.__repr__, torch.Tensor.__format__,
    torch.Tensor.__array__, torch.Tensor.data_ptr,
}


def _is_cpu_target(args: tuple, kwargs: dict) -> bool:
    for t in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu":
            return True
    return False


def _has_bool_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class DeviceIndex(torch.Tensor):
    reads: list[str] = []  # every refused read, in order (also raised)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_state, "depth", 0):
            read = (
                func in _READS
                or (func is torch.Tensor.to and _is_cpu_target(args, kwargs))
                or (func is torch.Tensor.__getitem__ and _has_bool_index(args))
            )
            if read:
                name = getattr(func, "__name__", str(func))
                cls.reads.append(name)
                raise HostRead(f"host read of a device-side index tensor: {name}")
        return super().__torch_function__(func, types, args, kwargs)


def wrap(t: Any) -> Any:
    return t.as_subclass(DeviceIndex) if isinstance(t, torch.Tensor) and not isinstance(t, DeviceIndex) else t


def unwrap(x: Any) -> Any:
    if isinstance(x, DeviceIndex):
        return x.as_subclass(torch.Tensor)
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(v) for v in x)
    return x
