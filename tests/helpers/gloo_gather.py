"""``all_gather_object`` over a bare gloo ProcessGroup (ranks as threads, one
group each), for tests that drive the start-up agreement without a default
process group."""

from __future__ import annotations

import pickle
from typing import Any

import torch


def object_all_gather(output: list, obj: Any, group: Any) -> None:
    """Fill ``output[i]`` with rank ``i``'s ``obj`` (signature of
    ``torch.distributed.all_gather_object``)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    n = group.size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    group.allgather([sizes], [torch.tensor([data.numel()])]).wait()
    width = max(int(s) for s in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.zeros(width, dtype=torch.uint8) for _ in range(n)]
    group.allgather([chunks], [padded]).wait()
    for i in range(n):
        output[i] = pickle.loads(bytes(chunks[i][: int(sizes[i])].tolist()))
