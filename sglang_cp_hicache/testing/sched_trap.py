"""A device-index trap inside the real scheduler: host reads of device
indices refused while the cache inserts (0.5.18).

On a GPU server ``req_to_token`` and every KV index taken from it live on
the device; reading one on the host (``.tolist()``, ``.cpu()``, ``int()``,
...) synchronises the stream. SGLang's scheduler reads them freely in places
of its own; what the library promises is that its inserts
(``cache_unfinished_req`` at each chunk checkpoint, ``cache_finished_req``)
read none. So the trap is scoped: the request pool's ``req_to_token`` becomes
a :class:`TrappedIndex` (every tensor derived from it stays one), and only
while an insert runs is a host read of one refused. A refused read raises
:class:`InsertHostRead` in the rank (failing the run, naming the read) and is
counted, so a test can also see a trap that was swallowed.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from typing import Any, Iterator

import torch

__all__ = ["InsertHostRead", "TrappedIndex", "device_work", "install_insert_trap", "strict"]

_state = threading.local()


class InsertHostRead(AssertionError):
    """A device index was read on the host while the cache inserted."""


@contextlib.contextmanager
def _depth(value: int) -> Iterator[None]:
    before = getattr(_state, "depth", 0)
    _state.depth = value
    try:
        yield
    finally:
        _state.depth = before


def strict() -> contextlib.AbstractContextManager[None]:
    """Host reads of a :class:`TrappedIndex` are refused inside."""
    return _depth(getattr(_state, "depth", 0) + 1)


def device_work() -> contextlib.AbstractContextManager[None]:
    """Inside, the code stands in for device work (the copy kernels, whose
    CPU backend validates the indices it is handed): reads are allowed."""
    return _depth(0)


_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.cpu,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.unique_consecutive,
    torch.Tensor.masked_select, torch.masked_select, torch.Tensor.bincount, torch.bincount,
    torch.equal, torch.Tensor.equal, torch.Tensor.__array__,
}


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is not torch.Tensor.to:
        return False
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu"
               for t in list(args[1:]) + [kwargs.get("device")])


class TrappedIndex(torch.Tensor):
    refused: list[str] = []  # every refused read in this process, in order

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_state, "depth", 0) and (func in _READS or _to_host(func, args, kwargs)):
            name = getattr(func, "__name__", str(func))
            cls.refused.append(name)
            # the message carries where: a caller may catch the error and report only its text
            where = "".join(traceback.format_stack(limit=8)[:-1])
            raise InsertHostRead(f"host read of a device index while the cache inserted: {name}, at\n{where}")
        return super().__torch_function__(func, types, args, kwargs)


def install_insert_trap(scheduler: Any) -> None:
    """Trap ``scheduler``'s request pool and run its cache's inserts strict
    (the library's copies inside them run as device work)."""
    from sglang_cp_hicache.kernels.bound import PoolCopies

    for name in ("backup", "load"):
        kernel = getattr(PoolCopies, name)

        def on_device(*args: Any, _kernel: Any = kernel, **kwargs: Any) -> Any:
            with device_work():
                return _kernel(*args, **kwargs)

        setattr(PoolCopies, name, on_device)
    pool = scheduler.req_to_token_pool
    pool.req_to_token = pool.req_to_token.as_subclass(TrappedIndex)
    cache = scheduler.tree_cache
    for name in ("cache_unfinished_req", "cache_finished_req"):
        inner = getattr(cache, name)

        def strict_insert(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            with strict():
                return _inner(*args, **kwargs)

        setattr(cache, name, strict_insert)
