"""How ``simulate --engine scheduler`` splits a request's prefix into device
and host hits from the load-backs rank 0 recorded (step: batches forwarded
when it ran) and the batches the scheduler forwarded. SGLang loads back
before its last admission checks, so a request can be turned away after its
load-back and run later from a smaller prefix (its pages evicted meanwhile):
a real run showed it (soak seed 451361252: q097 loaded 128 tokens back, ran
from prefix 0), and the summary called it a fault."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_cp_hicache.sim.report_scheduler import _l3_fields, _tiers
from sglang_cp_hicache.testing.sched_forward import BatchEntry
from sglang_cp_hicache.testing.sched_rank import LoadBack


def replay(load_backs: list[LoadBack], batches: list[tuple[int, list[BatchEntry]]]) -> SimpleNamespace:
    rank0 = SimpleNamespace(load_backs=load_backs)
    run = SimpleNamespace(ranks=[rank0], batches=[SimpleNamespace(step=s, entries=e) for s, e in batches])
    return SimpleNamespace(run=run)


def test_a_load_back_in_the_first_batchs_round_is_a_host_hit():
    tiers, unused, problems = _tiers(replay([LoadBack("a", 128, 128, step=3)],
                                            [(3, [BatchEntry("a", 192, 64)])]))
    assert (tiers, unused, problems) == ({"device": 64, "host": 128, "l3": 0}, 0, [])


def test_a_request_turned_away_after_its_load_back_and_run_from_scratch_wasted_it():
    tiers, unused, problems = _tiers(replay([LoadBack("q", 128, 128, step=201), LoadBack("q", 192, 0, step=203)],
                                            [(203, [BatchEntry("q", 0, 128)]), (204, [BatchEntry("q", 128, 128)])]))
    assert (tiers, unused, problems) == ({"device": 0, "host": 0, "l3": 0}, 128, [])


def test_pages_loaded_a_round_early_and_still_there_count_as_host():
    tiers, unused, problems = _tiers(replay([LoadBack("b", 192, 192, step=72)], [(73, [BatchEntry("b", 192, 8)])]))
    assert (tiers, unused, problems) == ({"device": 0, "host": 192, "l3": 0}, 0, [])


def test_a_load_back_after_the_first_batch_is_no_first_batch_hit():
    """A retracted request admitted again loads back for a later batch."""
    tiers, unused, problems = _tiers(replay([LoadBack("r", 64, 64, step=9)],
                                            [(2, [BatchEntry("r", 0, 64)]), (9, [BatchEntry("r", 64, 64)])]))
    assert (tiers, unused, problems) == ({"device": 0, "host": 0, "l3": 0}, 0, [])


def test_a_load_back_its_own_batch_did_not_start_from_is_a_fault():
    """Loaded in the round of the batch that forwarded the request, the
    tokens must be in that batch's prefix: otherwise the scheduler dropped
    indices it was handed."""
    tiers, unused, problems = _tiers(replay([LoadBack("c", 128, 128, step=5)], [(5, [BatchEntry("c", 64, 64)])]))
    assert problems == ["request c loaded back 128 tokens in its first batch's round but started it at prefix 64"]


def test_the_l3_tail_of_a_first_batchs_host_tokens_is_an_l3_hit():
    """--l3: SGLang's storage hit on the request (the tokens its L3 lookup
    restored into the host tree), as the first batch reported it, is taken
    out of the host tokens loaded back for it."""
    tiers, unused, problems = _tiers(replay([LoadBack("a", 192, 192, step=3)],
                                            [(3, [BatchEntry("a", 256, 64, l3_tokens=128)]),
                                             (4, [BatchEntry("a", 320, 1)])]))
    assert (tiers, unused, problems) == ({"device": 64, "host": 64, "l3": 128}, 0, [])


def test_l3_tokens_beyond_what_was_loaded_back_are_a_fault():
    tiers, _, problems = _tiers(replay([LoadBack("b", 64, 64, step=1)], [(1, [BatchEntry("b", 128, 64, l3_tokens=128)])]))
    assert problems == ["request b started from 128 L3 tokens but only 64 came from host"]


def test_l3_written_bytes_are_the_written_pages_bytes_and_kept_pages_are_apart():
    """A page written again and found sound in L3 (kept) is metered as
    written bytes by the rank's L3 but is no written page: the summary's
    written bytes match its written pages (as the loop engine's do)."""
    counters = [{"written_pages": 34, "kept_pages": 12}, {"written_pages": 40, "kept_pages": 13}]
    ranks = [SimpleNamespace(l3_counters=c, stats=SimpleNamespace(l3_verified=0), l3_read_failures=0,
                             l3_io={"written_bytes": (c["written_pages"] + c["kept_pages"]) * 100, "read_bytes": 0},
                             l3_page_bytes=100) for c in counters]
    fields = _l3_fields(SimpleNamespace(page_size=64), SimpleNamespace(l3_dir="/l3"),
                        SimpleNamespace(run=SimpleNamespace(ranks=ranks)), 0, problems := [])
    assert fields["l3_written_pages"] == 74 and fields["l3_written_bytes"] == 74 * 100, fields
    assert fields["l3_kept_pages"] == 25 and fields["l3_written_or_kept_bytes"] == 99 * 100 and problems == []
