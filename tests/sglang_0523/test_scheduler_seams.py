"""Every seam of the real-scheduler harness resolves in SGLang 0.5.23; a moved one fails loudly."""

from __future__ import annotations

from tests.helpers import sched_seam_checks as seams

VERSION = "0.5.23"


def test_every_seam_resolves_in_this_release():
    seams.check_every_seam_resolves(VERSION)


def test_a_moved_seam_target_fails_at_start_up_naming_the_seam(monkeypatch):
    seams.check_moved_target_fails_loudly(VERSION, monkeypatch)


def test_a_changed_seam_signature_fails_at_start_up(monkeypatch):
    seams.check_changed_signature_fails_loudly(VERSION, monkeypatch)


def test_a_worker_method_the_stand_in_mirrors_removed_fails_at_start_up(monkeypatch):
    seams.check_worker_method_removed_fails_loudly(VERSION, monkeypatch)


def test_an_unknown_release_is_refused():
    seams.check_unknown_release_refused()
