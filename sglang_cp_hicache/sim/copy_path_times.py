"""CPU time in a rank's copy path, as the simulator measures it: the
process CPU seconds of each wrapped call (``timed``), summed per phase
(:class:`CopyPathTimes`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["CopyPathTimes", "timed"]


@dataclass
class CopyPathTimes:
    """Process CPU seconds and calls in the sharded copy path on one rank."""

    copy_path: str
    prepare_seconds: float = 0.0  # _move_write_operation + _move_op_indices
    submit_seconds: float = 0.0  # L2 engine submit_device_to_host + submit_host_to_device
    prepare_calls: int = 0
    submit_calls: int = 0

    @property
    def total_seconds(self) -> float:
        return self.prepare_seconds + self.submit_seconds


def timed(fn: Callable[..., Any], add: Callable[[float], None]) -> Callable[..., Any]:
    """``fn``, passing the process CPU seconds of every call to ``add``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            add(time.process_time() - start)

    return wrapper
