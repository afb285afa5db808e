"""A trace costs what the docs say: token ids packed as they are parsed (4
bytes a token + 8 a request in every rank, 8 more a request in the launcher
for line numbers), pickled to the ranks as raw bytes; measured with
tracemalloc on synthetic traces, one-token lines (the worst case) included."""

from __future__ import annotations

import json
import pickle
import tracemalloc

import pytest

from sglang_cp_hicache.sim import launcher
from sglang_cp_hicache.sim.packed import PackedRequests
from sglang_cp_hicache.sim.workload import MAX_TRACE_TOKENS, SimRequest, load_trace, pack_requests

# array's growth (appending, and frombytes when a rank unpickles) over-allocates
# a sixteenth, plus a few elements
SLACK = 1.07


def _write(path, lines: int, tokens_per_line: int) -> str:
    # ids above 256: CPython caches the small ints, which would hide their cost
    line = json.dumps({"tokens": list(range(70_000, 70_000 + tokens_per_line))}) + "\n"
    path.write_text(line * lines)
    return str(path)


def _held_after(fn):
    """What ``fn`` allocated and still holds: only allocations whose call
    stack passes through this file, so another thread of the process (an
    xdist worker keeps whatever earlier tests left running) cannot count."""
    tracemalloc.start(8)
    try:
        result = fn()
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    ours = snapshot.filter_traces([tracemalloc.Filter(True, __file__, all_frames=True)])
    return result, sum(stat.size for stat in ours.statistics("filename"))


@pytest.mark.parametrize("lines,per_line", [(60_000, 1), (600, 100)], ids=["one-token-lines", "100-token-lines"])
def test_parsed_trace_and_each_ranks_copy_stay_within_the_documented_bytes(tmp_path, lines, per_line):
    path = _write(tmp_path / "t.jsonl", lines, per_line)
    tokens = lines * per_line
    # One small load first: what the first load in a process allocates once
    # (lazy imports, caches) is not a cost per token.
    load_trace(_write(tmp_path / "warm.jsonl", 3, per_line), seed=0)
    trace, held = _held_after(lambda: load_trace(path, seed=0))
    assert trace.packed.total_tokens == tokens and len(trace) == lines
    launcher_bound = SLACK * (4 * tokens + 16 * lines) + 4096
    assert 4 * tokens <= held <= launcher_bound, f"launcher holds {held / tokens:.1f} B a token"
    payload = pickle.dumps(trace.packed, protocol=pickle.HIGHEST_PROTOCOL)
    carried = len(payload)
    assert carried <= 4 * tokens + 8 * (lines + 1) + 512, f"pickle carries {carried / tokens:.1f} B a token"
    copy, held = _held_after(lambda: pickle.loads(payload))
    assert copy == trace.packed
    rank_bound = SLACK * (4 * tokens + 8 * lines) + 512
    assert 4 * tokens <= held <= rank_bound, f"a rank holds {held / tokens:.1f} B a token"
    if per_line == 1:  # the worst case: what docs/simulator.md quotes, 13 B a token (416 MiB at 2**25)
        assert held <= 13 * tokens


def test_the_cap_is_the_documented_one():
    assert MAX_TRACE_TOKENS == 1 << 25 and 13 * MAX_TRACE_TOKENS == 416 << 20


def test_packed_requests_read_back_every_request_and_refuse_ids_beyond_int32():
    lists = [[5], [70_000, 2**31 - 1, 0], [9] * 70]
    packed = PackedRequests.from_token_lists(lists)
    assert [list(r) for r in packed] == lists and [list(packed[i]) for i in (-1, 0)] == [lists[-1], lists[0]]
    with pytest.raises(IndexError):
        packed[3]
    with pytest.raises(OverflowError):
        packed.append([1, 2**31])
    assert [list(r) for r in pickle.loads(pickle.dumps(packed))] == lists  # the failed append left nothing


def test_the_cli_hands_the_ranks_packed_requests(tmp_path, monkeypatch):
    from sglang_cp_hicache.__main__ import main

    seen = []

    def fake(config, requests, **kwargs):
        seen.append(requests)
        return launcher.LaunchResult(label="fake", exit_codes={0: 1})

    monkeypatch.setattr(launcher, "launch", fake)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tokens": [7, 8, 9]}\n\n{"tokens": [1]}\n')
    assert main(["simulate", "--no-progress", "--engine", "loop", "--trace", str(trace)]) == 1
    assert isinstance(seen[0], PackedRequests) and [list(r) for r in seen[0]] == [[7, 8, 9], [1]]
    parsed = load_trace(trace, seed=0)
    assert [r.label for r in parsed] == ["trace:1", "trace:3"]
    assert pack_requests([SimRequest((4, 5))]) == PackedRequests.from_token_lists([[4, 5]])
