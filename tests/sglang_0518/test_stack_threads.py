"""CP ranks as threads of one process: building their stacks concurrently is
safe, and a rank that fails to build makes its peers stop at once with that
rank's error (not a 60 s gloo time-out that hides it)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from sglang_cp_hicache.testing import env
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig
from tests.helpers import cp_cluster, rank_failure
from tests.helpers.cp_cluster import CpCluster

THREADS = 6


def run_threads(fn, count: int = THREADS) -> list[BaseException]:
    """``fn()`` on ``count`` threads released together; the errors they raised."""
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def body():
        start.wait()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=body) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_server_args_are_built_one_at_a_time_and_leave_the_environment_alone(monkeypatch):
    from sglang.srt.server_args import ServerArgs

    env.make_cpu_server_args()  # first call imports and caches; not part of the race
    real = ServerArgs.__post_init__
    inside = {"now": 0, "most": 0}
    count_lock = threading.Lock()

    def slow_post_init(self):
        with count_lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        try:
            real(self)
            time.sleep(0.01)  # the variables it set stay set for a while
        finally:
            with count_lock:
                inside["now"] -= 1

    monkeypatch.setattr(ServerArgs, "__post_init__", slow_post_init)
    before = dict(os.environ)

    def build():
        for _ in range(4):
            args = env.make_cpu_server_args(page_size=64)
            assert args.page_size == 64 and args.enable_hierarchical_cache

    assert run_threads(build) == []
    assert inside["most"] == 1, "ServerArgs built concurrently"
    assert dict(os.environ) == before


def test_server_args_from_many_threads_unpatched():
    env.make_cpu_server_args()
    before = dict(os.environ)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        errors = run_threads(lambda: [env.make_cpu_server_args() for _ in range(25)], count=8)
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert dict(os.environ) == before


def test_preserved_environ_is_exclusive():
    order: list[str] = []

    def block(tag: str):
        with env.preserved_environ():
            os.environ["SGLANG_CP_HICACHE_TEST_VAR"] = tag
            order.append(f"in {tag}")
            time.sleep(0.02)
            assert os.environ["SGLANG_CP_HICACHE_TEST_VAR"] == tag
            order.append(f"out {tag}")

    errors = run_threads(lambda: block(threading.current_thread().name), count=4)
    assert errors == []
    assert "SGLANG_CP_HICACHE_TEST_VAR" not in os.environ
    assert all(a.split()[1] == b.split()[1] for a, b in zip(order[::2], order[1::2]))


class InjectedBuildError(RuntimeError):
    pass


class FailingBuild:
    """build_cp_rank_stack, except that ``bad_rank`` raises; with
    ``after_peers_wait`` only once every other rank waits in a collective
    (the start-up one), else at once."""

    def __init__(self, monkeypatch, bad_rank: int, after_peers_wait: bool) -> None:
        self.bad_rank, self.after_peers_wait = bad_rank, after_peers_wait
        self.groups: list = []
        self.raised_at = None
        self._real = cp_cluster.build_cp_rank_stack
        groups = self.groups

        class RecordedGroup(cp_cluster.FailFastGroup):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                groups.append(self)

        monkeypatch.setattr(cp_cluster, "FailFastGroup", RecordedGroup)
        monkeypatch.setattr(cp_cluster, "build_cp_rank_stack", self)

    def __call__(self, config, cp_rank, **kwargs):
        if cp_rank != self.bad_rank:
            return self._real(config, cp_rank, **kwargs)
        if self.after_peers_wait:
            peers = [g for g in self.groups if g.rank() != cp_rank]
            deadline = time.monotonic() + 120
            while not all(g.pending is not None for g in peers):
                assert time.monotonic() < deadline, "peers never reached a collective"
                time.sleep(0.01)
        self.raised_at = time.monotonic()
        raise InjectedBuildError(f"injected failure on cp_rank {cp_rank}")


@pytest.mark.parametrize(
    "cp_size, bad_rank, after_peers_wait", [(2, 1, True), (4, 2, True), (3, 0, True), (3, 1, False)]
)
def test_a_rank_failing_to_build_fails_the_cluster_fast_with_its_error(
    monkeypatch, cp_size, bad_rank, after_peers_wait
):
    failing = FailingBuild(monkeypatch, bad_rank, after_peers_wait)
    config = CpStackConfig(cp_size=cp_size, device_pages=3, host_pages=2, num_layers=1)
    with pytest.raises(InjectedBuildError, match=f"cp_rank {bad_rank}") as info:
        CpCluster(config, threaded=True, timeout_s=60)
    waited = time.monotonic() - failing.raised_at
    assert waited < 5, f"the cluster took {waited:.1f} s to report the failure"
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert f"cp_rank {bad_rank} of {cp_size} failed" in note
    # Every gloo group was released (none stranded with an operation in flight).
    assert all(g.released for g in failing.groups) and len(failing.groups) == cp_size
    assert rank_failure._STRANDED == []


def test_a_cluster_builds_after_a_failed_one(monkeypatch):
    FailingBuild(monkeypatch, 1, after_peers_wait=True)
    config = CpStackConfig(cp_size=2, device_pages=3, host_pages=2, num_layers=1)
    with pytest.raises(InjectedBuildError):
        CpCluster(config, threaded=True, timeout_s=60)
    monkeypatch.undo()
    cl = CpCluster(config, threaded=True, timeout_s=60)
    try:
        assert len(cl.insert(list(range(1, 65)))) == 2
    finally:
        cl.close()
