"""The real-scheduler harness's seam registry, pinned (both releases)."""

from __future__ import annotations

from typing import Callable

import pytest

from sglang_cp_hicache.testing import sched_seams
from sglang_cp_hicache.testing.sched_seams import SeamMismatchError, check_seams, seams_for


def check_every_seam_resolves(version: str) -> None:
    check_seams(version)
    seams = seams_for(version)
    names = [s.name for s in seams]
    assert len(names) == len(set(names))
    assert {"model-worker", "worker-interface", "dsa-model", "pd-transfer", "pd-overlap-event",
            "environment"} <= set(names)
    assert ("uvloop" in names) == (version == "0.5.18")
    for seam in seams:
        assert "sglang/srt/" in seam.stands_in_for and seam.why, seam
    # every seam that replaces or relies on an SGLang name lists it
    assert all(s.hooks for s in seams if s.name not in ("web-stack-imports",)), seams


def check_moved_target_fails_loudly(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that renamed what a seam replaces refuses at start-up, naming the seam and the name."""
    sched_seams.import_only_stand_ins(version)  # SGLang's scheduler module imports them; this test may run first
    from sglang.srt.mem_cache import kv_cache_builder

    monkeypatch.delattr(kv_cache_builder, "is_deepseek_dsa")
    with pytest.raises(SeamMismatchError, match=r"seam 'dsa-model'.*is_deepseek_dsa"):
        check_seams(version)


def check_changed_signature_fails_loudly(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sched_seams.import_only_stand_ins(version)
    from sglang.srt.managers.scheduler import Scheduler

    def init_tp_model_worker(self, worker_kwargs):  # a release that started passing an argument
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "init_tp_model_worker", init_tp_model_worker)
    with pytest.raises(SeamMismatchError, match=r"seam 'model-worker'.*init_tp_model_worker.*worker_kwargs"):
        check_seams(version)


def check_worker_method_removed_fails_loudly(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sched_seams.import_only_stand_ins(version)
    from sglang.srt.managers.tp_worker import TpModelWorker

    owner = next(k for k in TpModelWorker.__mro__ if "get_memory_pool" in vars(k))
    monkeypatch.delattr(owner, "get_memory_pool")
    with pytest.raises(SeamMismatchError, match=r"seam 'worker-interface'.*get_memory_pool"):
        check_seams(version)


def check_unknown_release_refused() -> None:
    with pytest.raises(ValueError, match="version"):
        sched_seams.seams_for("0.5.99")


def seam_tests(version: str) -> dict[str, Callable]:
    """The seam tests of ``version``'s test module, by name (``globals().update``: pytest collects them there)."""

    def test_every_seam_resolves_in_this_release():
        check_every_seam_resolves(version)

    def test_a_moved_seam_target_fails_at_start_up_naming_the_seam(monkeypatch):
        check_moved_target_fails_loudly(version, monkeypatch)

    def test_a_changed_seam_signature_fails_at_start_up(monkeypatch):
        check_changed_signature_fails_loudly(version, monkeypatch)

    def test_a_worker_method_the_stand_in_mirrors_removed_fails_at_start_up(monkeypatch):
        check_worker_method_removed_fails_loudly(version, monkeypatch)

    def test_an_unknown_release_is_refused():
        check_unknown_release_refused()

    return {f.__name__: f for f in (
        test_every_seam_resolves_in_this_release, test_a_moved_seam_target_fails_at_start_up_naming_the_seam,
        test_a_changed_seam_signature_fails_at_start_up,
        test_a_worker_method_the_stand_in_mirrors_removed_fails_at_start_up, test_an_unknown_release_is_refused)}
