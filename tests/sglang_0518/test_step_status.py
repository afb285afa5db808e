"""The step status folded into SGLang's two ready-ack words: a MIN all-reduce
of the packed words must tell every rank exactly what independent reduces of
(ack counts, write vote, first failed write, load vote) would, and never be
wider than SGLang's own vector."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.sglang_0518.step_status import MAX_COUNT, NO_CUT, StepStatus, Vote

FAILURES = st.lists(  # one rank's write failures of a step, in the order they happened
    st.tuples(st.sampled_from([Vote.FAILED, Vote.REFUSED]), st.integers(0, 40)), max_size=3,
)
RANK = st.tuples(
    st.integers(0, 5000),  # ready write acks
    st.integers(0, 5000),  # ready load acks
    FAILURES,  # write failures: (vote, offset from the oldest in-flight write)
    st.one_of(st.none(), st.just(Vote.FAILED)),  # load failure
)


def packed_reduce(ranks, first_seq):
    words = []
    for write_acks, load_acks, write_fails, load_fail in ranks:
        s = StepStatus()
        for vote, offset in write_fails:
            s.fail_write(vote, first_seq + offset)
        if load_fail is not None:
            s.fail_load(load_fail, 7)
        words.append(torch.tensor(s.words(write_acks, load_acks, first_seq), dtype=torch.int64))
    reduced = torch.stack(words).min(dim=0).values  # what gloo's MIN all-reduce returns
    return StepStatus.read(reduced.tolist())


@settings(max_examples=400, deadline=None)
@given(st.lists(RANK, min_size=1, max_size=8), st.integers(0, 2**45))
def test_one_min_over_two_words_equals_the_independent_reduces(ranks, first_seq):
    step = packed_reduce(ranks, first_seq)
    write_fails = [w for _, _, fails, _ in ranks for w in fails]
    load_fails = [l for _, _, _, l in ranks if l is not None]
    any_failure = bool(write_fails or load_fails)
    # Counts: the true MIN when nothing failed; none consumed in a failure step.
    assert step.write_acks == (0 if any_failure else min(r[0] for r in ranks))
    assert step.load_acks == (0 if any_failure else min(r[1] for r in ranks))
    # Writes: the earliest failure anywhere is the cut; FAILED anywhere wins the vote.
    if write_fails:
        assert step.write.cut == min(off for _, off in write_fails)
        assert step.write.vote == min(v for v, _ in write_fails)
    else:
        assert step.write.ok and step.write.cut == NO_CUT
    # Loads: taken back when any rank failed one, or any rank FAILED a write
    # (every rank raises then, and no load-back outlives the raise).
    write_failed = any(v == Vote.FAILED for v, _ in write_fails)
    assert step.load.ok == (not load_fails and not write_failed)
    if load_fails and not write_failed:
        assert step.load.vote == Vote.FAILED  # every rank raises for the load-back
    if write_failed:
        assert step.write.vote == Vote.FAILED  # every rank raises for the backup


def test_a_refused_write_before_a_failed_one_cuts_at_the_refused_one_and_raises():
    # rank 0: host short at write 3 (REFUSED); rank 1: copy raised at write 5
    step = packed_reduce([(4, 4, [(Vote.REFUSED, 3)], None), (4, 4, [(Vote.FAILED, 5)], None)], 100)
    assert (step.write.vote, step.write.cut) == (Vote.FAILED, 3)
    assert not step.load.ok  # taken back with the raise


@pytest.mark.parametrize("order", ["refused first", "failed first"])
def test_one_rank_keeps_its_earliest_failed_write_and_its_worst_vote_with_the_error(order):
    """A refused and a failed write on the SAME rank: the cut is the earlier
    write, the vote FAILED (every rank raises), the error the copy's."""
    copy_error = RuntimeError("DMA error")
    s = StepStatus()
    calls = [(Vote.REFUSED, 3, None), (Vote.FAILED, 5, copy_error)]
    for vote, seq, error in calls if order == "refused first" else reversed(calls):
        s.fail_write(vote, seq, error)
    assert (s.write.vote, s.write.seq, s.write.error) == (Vote.FAILED, 3, copy_error)
    step = StepStatus.read(s.words(0, 0, 3))
    assert (step.write.vote, step.write.cut) == (Vote.FAILED, 0)


def test_of_two_failed_writes_the_first_error_is_kept():
    first, second = RuntimeError("first"), RuntimeError("second")
    s = StepStatus()
    s.fail_write(Vote.FAILED, 7, first)
    s.fail_write(Vote.FAILED, 4, second)
    assert (s.write.seq, s.write.error) == (4, first)


def test_counts_above_the_field_are_clamped_not_wrapped():
    step = packed_reduce([(MAX_COUNT + 10, 2**40, [], None)], 0)
    assert (step.write_acks, step.load_acks) == (MAX_COUNT, MAX_COUNT)
    assert step.write.ok and step.load.ok


def test_every_word_is_a_nonnegative_int64():
    s = StepStatus()
    s.fail_write(Vote.REFUSED, 10 + NO_CUT - 1)
    words = s.words(MAX_COUNT, MAX_COUNT, 10)
    assert all(0 <= w < 2**63 for w in words)
    assert StepStatus().words(0, 0, None) == [(NO_CUT << 23) | (2 << 21), (1 << 23) | (2 << 21)]


@pytest.mark.parametrize("seq, first", [(5, None), (5, 6)])
def test_a_failed_write_that_is_not_in_flight_is_an_internal_error(seq, first):
    s = StepStatus()
    s.fail_write(Vote.REFUSED, seq)
    with pytest.raises(RuntimeError, match="not in flight"):
        s.words(0, 0, first)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="ack counts"):
        StepStatus().words(-1, 0, None)
