"""Mooncake FAST'25 traces as simulator requests, the ideal they are read
against, and what the CLI refuses before any rank starts (no rank starts in
this file)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from sglang_cp_hicache.sim import launcher
from sglang_cp_hicache.sim.ideal import ideal_hit_tokens
from sglang_cp_hicache.sim.mooncake import BlockTokens, scaled_length
from sglang_cp_hicache.sim.workload import TraceError, load_trace
from tests.sim.simrun import ROOT, sim_command, sim_env

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"
P = 64


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(tmp_path: Path, *objs: object, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def _line(ts: int, n: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n, "output_length": 7, "hash_ids": ids}


# ---------------------------------------------------------------------------
# The format, at every block scale
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_tokens", [1, 63, 64, 512])
def test_the_committed_slice_replays_at_any_scale_sharing_exactly_the_equal_ids(block_tokens):
    rows = _lines(SLICE)
    trace = load_trace(SLICE, seed=0, block_tokens=block_tokens)
    assert len(trace) == len(rows) == 60
    info = trace.info.as_dict()
    assert info["trace_format"] == "mooncake" and info["trace_block_tokens"] == block_tokens
    assert info["trace_timestamps_ms"] == [rows[0]["timestamp"], rows[-1]["timestamp"]]
    assert info["trace_distinct_blocks"] == len({h for r in rows for h in r["hash_ids"]})
    for row, req in zip(rows, trace):
        n, tail = len(row["hash_ids"]), row["input_length"] - 512 * (len(row["hash_ids"]) - 1)
        assert len(req) == block_tokens * (n - 1) + math.ceil(tail * block_tokens / 512)
        if block_tokens == 512:
            assert len(req) == row["input_length"]  # the real lengths
    # two lines share exactly the tokens of their common leading ids
    for (ra, a), (rb, b) in zip(zip(rows, trace), list(zip(rows, trace))[1:]):
        common = 0
        while common < min(len(ra["hash_ids"]), len(rb["hash_ids"])) and \
                ra["hash_ids"][common] == rb["hash_ids"][common]:
            common += 1
        shared = min(common * block_tokens, len(a), len(b))
        assert a.tokens[:shared] == b.tokens[:shared]
        if common < min(len(ra["hash_ids"]), len(rb["hash_ids"])) - 1:  # a whole differing block follows
            start = common * block_tokens
            assert a.tokens[start:start + block_tokens] != b.tokens[start:start + block_tokens]


def test_an_id_is_the_same_tokens_in_any_line_file_or_run(tmp_path):
    a = load_trace(_write(tmp_path, _line(0, 1100, [5, 6, 7]), name="a.jsonl"), seed=0)
    b = load_trace(_write(tmp_path, _line(3, 600, [9, 6]), _line(4, 1024, [5, 6]), name="b.jsonl"), seed=99)
    assert a[0].tokens[:128] == b[1].tokens  # [5, 6] at the front of both
    assert a[0].tokens[64:75] == b[0].tokens[64:]  # id 6 after another id, cut to 11 tokens: its block's start
    assert BlockTokens(64).block(6) == BlockTokens(64).block(6)
    assert scaled_length(1100, 3, 64) == 128 + math.ceil(76 * 64 / 512) == len(a[0])


def test_requests_takes_the_first_lines(tmp_path):
    first = load_trace(SLICE, seed=0, limit=7)
    assert [r.tokens for r in first] == [r.tokens for r in load_trace(SLICE, seed=0)][:7]
    assert first.line_numbers.tolist() == list(range(1, 8))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"timestamp": 5, "input_length": 100}, "not a Mooncake line (no 'hash_ids')"),
        ({"input_length": 100, "hash_ids": [1]}, "'timestamp' is missing"),
        (_line(5, 1100, [1, 2]), "'hash_ids' has 2 ids, but input_length 1100 makes 3 blocks"),
        (_line(5, 0, [1]), "'input_length' must be a positive integer"),
        (_line(5, 100, [-1]), "'hash_ids'[0] must be an integer in [0, 2**63)"),
        (_line(5, 100, [True]), "'hash_ids'[0] must be an integer"),
        (_line(5, 100, []), "'hash_ids' must be a non-empty list"),
        ({**_line(5, 100, [1]), "output_length": -1}, "'output_length' must be a non-negative integer"),
        (_line(-1, 100, [1]), "'timestamp' must be a non-negative integer"),
        (_line(2, 100, [1]), "'timestamp' 2 is earlier than line 1's 3"),
        ({"tokens": [1, 2, 3]}, "not a Mooncake line (no 'hash_ids')"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_a_malformed_mooncake_line_is_refused_with_its_number(tmp_path, line, message):
    path = _write(tmp_path, _line(3, 600, [1, 2]), line)
    with pytest.raises(TraceError) as exc:
        load_trace(path, seed=0)
    assert exc.value.line_no == 2 and str(exc.value).startswith(f"{path}:2: ")
    assert message in str(exc.value)


def test_formats_do_not_mix_and_the_block_scale_needs_a_mooncake_file(tmp_path):
    tokens_first = _write(tmp_path, {"tokens": [1, 2]}, _line(0, 10, [1]), name="mixed.jsonl")
    with pytest.raises(TraceError, match=r":2: a Mooncake line \('hash_ids'\) in a trace whose first line"):
        load_trace(tokens_first, seed=0)
    with pytest.raises(TraceError, match="--trace-block-tokens applies to a Mooncake trace"):
        load_trace(_write(tmp_path, {"tokens": [1, 2]}), seed=0, block_tokens=64)
    with pytest.raises(TraceError, match=r":1: request has 640 tokens but the simulated device holds at most 600"):
        load_trace(_write(tmp_path, _line(0, 5120, list(range(10)))), seed=0, max_tokens=600)


# ---------------------------------------------------------------------------
# The ideal
# ---------------------------------------------------------------------------


def test_the_ideal_counts_whole_pages_up_to_the_first_page_never_seen():
    page = list(range(P))

    def pages(*ids: int, tail: int = 0) -> list[int]:
        return [t + 1000 * i for i in ids for t in page] + [7] * tail

    requests = [
        pages(1, 2, 3),           # nothing seen: 0
        pages(1, 2, 4, tail=10),  # pages 1, 2: 128 (the partial page is never matched)
        pages(1, 2, 4, 5),        # 1, 2, 4 (4 was cached whole by the last request): 192
        pages(9, 2, 3),           # page 2 after another page is another prefix: 0
        pages(1, 2, 3, tail=63),  # 1, 2, 3: 192
        pages(1, 2),              # a request that is all cached pages: 128
    ]
    assert ideal_hit_tokens(requests, P) == [0, 128, 192, 0, 192, 128]
    assert ideal_hit_tokens([pages(1)[:63], pages(1)[:63]], P) == [0, 0]  # sub-page requests hit nothing


def test_the_ideal_of_the_slice_matches_the_blocks_whole_prefix_count():
    """At one page a hash id the ideal is the README's block count (a block
    counts when it and every block before it were seen) less partial blocks."""
    rows = _lines(SLICE)
    seen: set[tuple[int, ...]] = set()
    want = 0
    for row in rows:
        ids = row["hash_ids"]
        whole = len(ids) if row["input_length"] % 512 == 0 else len(ids) - 1
        k = 0
        while k < len(ids) and tuple(ids[: k + 1]) in seen:
            k += 1
        want += min(k, whole) * P
        seen.update(tuple(ids[: j + 1]) for j in range(len(ids)))
    got = ideal_hit_tokens(load_trace(SLICE, seed=0).packed, P)
    assert sum(got) == want == 40_128


# ---------------------------------------------------------------------------
# Refused before any rank starts
# ---------------------------------------------------------------------------


def test_cli_refuses_a_bad_trace_or_scale_with_exit_2(tmp_path, capsys, monkeypatch):
    from sglang_cp_hicache.__main__ import main

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a rank was launched"))
    bad = _write(tmp_path, _line(3, 600, [1, 2]), _line(2, 100, [1]))
    assert main(["simulate", "--no-progress", "--engine", "loop", "--trace", str(bad)]) == 2
    assert f"error: {bad}:2: 'timestamp' 2 is earlier" in capsys.readouterr().err
    assert main(["simulate", "--no-progress", "--engine", "loop", "--trace-block-tokens", "64"]) == 2
    assert "--trace-block-tokens needs --trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--trace", str(SLICE), "--trace-block-tokens", "513"])
    assert exc.value.code == 2 and "--trace-block-tokens must be an integer in [1, 512]" in capsys.readouterr().err




@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {"SGLANG_CP_HICACHE_HOST_BALANCE": "gredy"},
         "SGLANG_CP_HICACHE_HOST_BALANCE='gredy' is not valid; use one of: exact, greedy"),
        (("--cp", "4"), {}, "unrecognized arguments: --cp 4"),
        (("--request", "10"), {}, "unrecognized arguments: --request 10"),
    ],
    ids=["misspelt-setting", "abbreviated-cp-size", "abbreviated-requests"],
)
def test_a_bad_setting_or_an_abbreviated_flag_exits_2_at_once_leaving_nothing(args, env, message, tmp_path):
    # a temporary directory of its own: other tests' runs write theirs meanwhile
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(sim_command(*args), cwd=ROOT, env=sim_env({**env, "TMPDIR": str(tmp)}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("usage:") and line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""
    assert os.listdir(tmp) == []  # no rank log directory: no rank started
