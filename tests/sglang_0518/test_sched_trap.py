"""The insert trap the 0.5.18 scheduler scenarios run under
(sglang_cp_hicache/testing/sched_trap.py): a host read of the request pool's
indices, or of anything taken from them, raises only while an insert runs,
and never inside the copies (device work). Through the real scheduler, the
scenarios pass with it on; with the request-row mirror switched off (the
code before the inserts took their pages from it) the first chunk
checkpoint failed on ``value[::P].to("cpu")`` in ``pages_for``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.testing.sched_trap import InsertHostRead, TrappedIndex, device_work, install_insert_trap


class _Cache:
    def __init__(self, pool) -> None:
        self.pool = pool
        self.read = None

    def cache_unfinished_req(self, req, chunked=False):
        self.read = self.pool.req_to_token[req, :4].tolist()  # what the old insert did: a host read

    def cache_finished_req(self, req, is_insert=True):
        self.read = self.pool.req_to_token[req, :4].sum()  # device work only: no read


@pytest.fixture(autouse=True)
def _copies_restored(monkeypatch):
    """install_insert_trap wraps the copy classes of the (rank) process: undone after each test here."""
    from sglang_cp_hicache.kernels.bound import PoolCopies

    for name in ("backup", "load"):
        monkeypatch.setattr(PoolCopies, name, getattr(PoolCopies, name))


def _scheduler():
    pool = SimpleNamespace(req_to_token=torch.arange(32, dtype=torch.int32).view(4, 8))
    return SimpleNamespace(req_to_token_pool=pool, tree_cache=_Cache(pool))


def test_a_host_read_inside_an_insert_raises_and_is_counted(monkeypatch):
    monkeypatch.setattr(TrappedIndex, "refused", [])
    sched = _scheduler()
    install_insert_trap(sched)
    rows = sched.req_to_token_pool.req_to_token
    assert rows[1, :2].tolist() == [8, 9]  # the scheduler's own reads, outside an insert
    with pytest.raises(InsertHostRead, match="tolist"):
        sched.tree_cache.cache_unfinished_req(1)
    sched.tree_cache.cache_finished_req(2)  # no read: passes
    assert TrappedIndex.refused == ["tolist"]
    assert int(sched.tree_cache.read) == 16 + 17 + 18 + 19


def test_reads_of_derived_indices_are_trapped_and_device_work_is_not():
    sched = _scheduler()
    install_insert_trap(sched)
    derived = (sched.req_to_token_pool.req_to_token[0, :4].to(torch.int64) // 2) + 1
    from sglang_cp_hicache.testing.sched_trap import strict

    with strict():
        with pytest.raises(InsertHostRead):
            derived.to("cpu")
        with pytest.raises(InsertHostRead):
            int(derived[0])
        with device_work():
            assert derived.tolist() == [1, 1, 2, 2]
