"""A trace is untrusted input: every limit is enforced before tokens are
generated or memory grows, and every violation names the file and the line
(exit status 2, no traceback)."""

from __future__ import annotations

import json
import resource
import subprocess

import pytest

from sglang_cp_hicache.sim import workload
from sglang_cp_hicache.sim.workload import (
    MAX_REQUEST_TOKENS,
    MAX_TRACE_LINE_BYTES,
    TraceError,
    load_trace,
)
from tests.sim.simrun import ROOT, sim_command, sim_env


@pytest.fixture
def no_generation(monkeypatch):
    """Fail the test if any token is generated."""
    def refuse(rng, n):
        raise AssertionError(f"generated {n} tokens for a request that must be rejected first")

    monkeypatch.setattr(workload, "_tokens", refuse)


def write_lines(path, *lines: bytes) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def test_huge_prompt_len_is_rejected_before_generation(tmp_path, no_generation):
    trace = write_lines(tmp_path / "t.jsonl", b'{"tokens": [1, 2]}',
                        b'{"prompt_len": 100000000000, "prefix_group": "g"}')
    with pytest.raises(TraceError) as exc:
        load_trace(trace, seed=0, max_tokens=4096)
    assert str(exc.value) == (f"{trace}:2: request has 100000000000 tokens but the simulated device holds "
                              f"at most 4096 (raise --device-pages)")
    # without a pool bound, the hard per-request cap applies
    with pytest.raises(TraceError, match=rf":2: request has 100000000000 tokens; the simulator replays at most "
                                         rf"{MAX_REQUEST_TOKENS} per request"):
        load_trace(trace, seed=0)


def test_a_tokens_list_over_the_bound_is_rejected_by_its_length(tmp_path):
    trace = write_lines(tmp_path / "t.jsonl", json.dumps({"tokens": [1] * 70}).encode())
    with pytest.raises(TraceError, match=r":1: request has 70 tokens but the simulated device holds at most 64"):
        load_trace(trace, seed=0, max_tokens=64)


def test_the_whole_trace_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(workload, "MAX_TRACE_TOKENS", 1000)
    line = b'{"prompt_len": 400, "prefix_group": "g"}'
    trace = write_lines(tmp_path / "t.jsonl", line, line, line)
    with pytest.raises(TraceError, match=r":3: the trace exceeds 1000 tokens in total at this line"):
        load_trace(trace, seed=0)
    assert len(load_trace(trace, seed=0, limit=2)) == 2  # --requests keeps it under the bound


def test_a_line_longer_than_the_cap_is_rejected_after_one_bounded_read(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"tokens": [5]}\n' + b" " * (MAX_TRACE_LINE_BYTES + 1) + b'{"tokens": [5]}\n')
    with pytest.raises(TraceError) as exc:
        load_trace(path, seed=0)
    assert str(exc.value).startswith(f"{path}:2: line 2 longer than {MAX_TRACE_LINE_BYTES} bytes (16 MiB)")
    # exactly at the cap (newline excluded) is accepted
    path.write_bytes(b'{"tokens": [5]}' + b" " * (MAX_TRACE_LINE_BYTES - 15) + b"\n")
    assert [r.tokens for r in load_trace(path, seed=0)] == [(5,)]


def test_dev_zero_fails_fast_naming_the_line():
    with pytest.raises(TraceError) as exc:
        load_trace("/dev/zero", seed=0)
    assert str(exc.value).startswith("/dev/zero:1: line 1 longer than")


@pytest.mark.parametrize(
    "line, message",
    [
        (b'{"tokens": [1], "note": "caf\xe9"}', "not UTF-8: byte b'\\xe9' at column 29"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON (nested too deeply)"),
        (b'{"prompt_len": ' + b"9" * 5000 + b', "prefix_group": 1}', "invalid JSON (Exceeds the limit (4300 digits)"),
    ],
    ids=["non-utf8", "deep-nesting", "int-over-4300-digits"],
)
def test_undecodable_lines_name_file_and_line(tmp_path, line, message):
    trace = write_lines(tmp_path / "t.jsonl", b'{"tokens": [5]}', line)
    with pytest.raises(TraceError) as exc:
        load_trace(trace, seed=0)
    assert str(exc.value).startswith(f"{trace}:2: {message}"), str(exc.value)


def test_lines_after_the_limit_are_not_read(tmp_path):
    trace = write_lines(tmp_path / "t.jsonl", b'{"tokens": [5]}', b"\xff not even text")
    assert [r.tokens for r in load_trace(trace, seed=0, limit=1)] == [(5,)]


def test_a_byte_order_mark_opening_the_file_is_accepted(tmp_path):
    trace = write_lines(tmp_path / "t.jsonl", b'\xef\xbb\xbf{"tokens": [5]}', b'{"tokens": [6]}')
    assert [r.tokens for r in load_trace(trace, seed=0)] == [(5,), (6,)]


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt_len": 100000000000, "prefix_group": "g"}\n', "request has 100000000000 tokens"),
        (b"[" * 100_000 + b"\n", "invalid JSON (nested too deeply)"),
        (b'{"tokens": [1]}\n{"tokens": "\xff"}\n', "not UTF-8"),
        (b'{"prompt_len": ' + b"1" * 4400 + b', "prefix_group": 1}\n', "invalid JSON (Exceeds the limit"),
    ],
    ids=["prompt-len", "deep-nesting", "non-utf8", "long-int"],
)
def test_cli_exits_2_naming_file_and_line_without_a_traceback(tmp_path, capsys, monkeypatch, content, message):
    from sglang_cp_hicache.__main__ import main
    from sglang_cp_hicache.sim import launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a rank was launched"))
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(content)
    assert main(["simulate", "--no-progress", "--engine", "loop", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    line = 2 if content.startswith(b'{"tokens": [1]}') else 1
    assert f"error: {trace}:{line}: " in err and message in err, err
    assert "Traceback" not in err


def _limit_memory() -> None:
    # an unbounded read of /dev/zero must hit this instead of the machine's memory
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = 6 << 30 if hard == resource.RLIM_INFINITY else min(6 << 30, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def test_cli_on_dev_zero_exits_2_at_once():
    proc = subprocess.run(sim_command("--trace", "/dev/zero"), cwd=ROOT, env=sim_env(), capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_memory)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: /dev/zero:1: line 1 longer than 16777216 bytes (16 MiB)" in proc.stderr
    assert "Traceback" not in proc.stderr
