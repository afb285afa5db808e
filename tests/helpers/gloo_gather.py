"""``all_gather_object`` over a bare gloo ProcessGroup (ranks as threads, one
group each), for tests that drive the start-up agreement without a default
process group."""

from __future__ import annotations

import pickle
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from sglang_cp_hicache.agreement import CpAgreementError


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


def agreement_on_threads(name: str, run: Callable[[int, Any], Any], world: int = 3) -> dict[int, str]:
    """``run(rank, group)`` on ``world`` threads, each with its own gloo group
    (prefix ``name`` on one in-memory store); each rank's verdict: ``"ok"``,
    or the message of the :class:`CpAgreementError` it raised."""
    store, results = dist.HashStore(), {}

    def rank_main(r: int) -> None:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), r, world)
        try:
            run(r, pg)
            results[r] = "ok"
        except CpAgreementError as exc:
            results[r] = str(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results
