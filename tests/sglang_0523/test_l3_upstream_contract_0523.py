"""The 0.5.23 L3 driver's ride on upstream's ready-ack all-reduce, pinned
against the installed source: ``_sync_hicache_ready_counts`` MIN-reduces
one 1-D tensor with one ``self._all_reduce`` call and reads it back by
position (what :class:`~sglang_cp_hicache.sglang_0523.l3_cache.L3Driver`
recognises and extends). A release that changes any of it fails here
instead of losing the lookup words silently."""

from __future__ import annotations

import ast
import inspect
import textwrap

from sglang_cp_hicache.testing.cpu_0523 import ensure_sglang_importable


def _sync_body() -> ast.FunctionDef:
    ensure_sglang_importable()
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return ast.parse(textwrap.dedent(inspect.getsource(UnifiedRadixCache._sync_hicache_ready_counts))).body[0]


def test_the_ready_counts_are_one_min_all_reduce_of_one_1d_tensor():
    body = _sync_body()
    reduces = [ast.unparse(n) for n in ast.walk(body) if isinstance(n, ast.Call)
               and getattr(n.func, "attr", None) in ("_all_reduce", "_all_reduce_attn_groups", "all_reduce")]
    assert sorted(reduces) == sorted([
        "self._all_reduce(ready_counts, torch.distributed.ReduceOp.MIN)",
        "self._all_reduce_attn_groups(ready_counts, torch.distributed.ReduceOp.MIN)",
    ]), reduces
    (made,) = [n for n in ast.walk(body) if isinstance(n, ast.Assign)
               and [ast.unparse(t) for t in n.targets] == ["ready_counts"]]
    assert ast.unparse(made.value).startswith("torch.tensor([")  # a flat list: one dimension
    assert "dtype=torch.int64" in ast.unparse(made.value)


def test_upstream_reads_the_reduced_counts_by_position_from_the_front_and_the_back():
    text = ast.unparse(_sync_body())
    # The driver appends its words and copies back exactly upstream's part,
    # so upstream's slices of its own tensor see what they always saw.
    assert "count_values = list(map(int, ready_counts.tolist()))" in text
    assert "count_values[-2]" in text and "count_values[-1]" in text and "count_values[2:-2]" in text
