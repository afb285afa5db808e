"""Allocator checkpoints close only once, and only innermost first: closing a
closed checkpoint (or an outer one while an inner one is open) raises and
changes nothing, so a newer checkpoint's owner can still roll back."""

from __future__ import annotations

import pytest

from sglang_cp_hicache.policy_0518.allocator import OwnerLaneAllocator


def _allocator() -> OwnerLaneAllocator:
    return OwnerLaneAllocator(4 * 16, 4, 2)


@pytest.mark.parametrize("close_first", ["commit", "rollback"])
@pytest.mark.parametrize("again", ["commit", "rollback"])
def test_a_closed_checkpoint_cannot_close_a_newer_one(close_first, again):
    alloc = _allocator()
    old = alloc.checkpoint()
    alloc.alloc_mirrored(8)
    getattr(alloc, close_first)(old)
    start = alloc.snapshot()
    new = alloc.checkpoint()  # same depth as the closed one
    alloc.alloc_mirrored(8)
    during = alloc.snapshot()
    closed = r"is not open on this allocator \(committed, rolled back, cleared, or taken from another allocator\)"
    with pytest.raises(ValueError, match=closed + r"; nothing was changed"):
        getattr(alloc, again)(old)
    assert alloc.snapshot() == during
    alloc.rollback(new)  # the newer owner can still take its pages back
    assert alloc.snapshot() == start


@pytest.mark.parametrize("close", ["commit", "rollback"])
def test_an_outer_checkpoint_cannot_close_while_an_inner_one_is_open(close):
    alloc = _allocator()
    outer = alloc.checkpoint()
    alloc.alloc_mirrored(4)
    inner = alloc.checkpoint()
    alloc.alloc_mirrored(8)
    during = alloc.snapshot()
    with pytest.raises(ValueError, match=r"is not the innermost open checkpoint.*nothing was changed"):
        getattr(alloc, close)(outer)
    assert alloc.snapshot() == during
    alloc.rollback(inner)
    alloc.rollback(outer)
    assert alloc.pages_in_use() == 0


def _refused_unchanged(alloc, checkpoint):
    """Neither commit nor rollback takes ``checkpoint``; ``alloc`` stays as it was."""
    during = alloc.snapshot()
    for close in (alloc.commit, alloc.rollback):
        with pytest.raises(ValueError, match="is not open on this allocator"):
            close(checkpoint)
    assert alloc.snapshot() == during


@pytest.mark.parametrize("reset", ["clear", "restore"])
def test_checkpoints_from_before_a_clear_or_restore_stay_closed(reset):
    alloc = _allocator()
    snapshot = alloc.snapshot()
    old = alloc.checkpoint()
    alloc.alloc_mirrored(4)
    alloc.clear() if reset == "clear" else alloc.restore(snapshot)
    new = alloc.checkpoint()
    alloc.alloc_mirrored(8)
    _refused_unchanged(alloc, old)
    alloc.rollback(new)
    assert alloc.pages_in_use() == 0


def test_a_checkpoint_of_another_allocator_is_refused():
    a, b = _allocator(), _allocator()
    foreign = b.checkpoint()
    mine = a.checkpoint()
    a.alloc_mirrored(4)
    _refused_unchanged(a, foreign)
    a.rollback(mine)
    b.commit(foreign)
    assert a.pages_in_use() == b.pages_in_use() == 0
