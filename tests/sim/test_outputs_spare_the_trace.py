"""An output path (--json, --plot) that names the trace the run reads, or
the other output, is refused before the run: exit 2, a message naming both
flags, the trace untouched, no rank started. "Names" means the same file:
the same path spelt differently, a symlink or a hard link."""

from __future__ import annotations

import os

import pytest

from sglang_cp_hicache.sim import launcher
from sglang_cp_hicache.sim.outputs import OutputPathError, check_output_paths
from tests.sim.simrun import with_engine

TRACE = '{"tokens": [1, 2, 3]}\n'


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a rank was launched"))


def run_cli(*args: str) -> int:
    from sglang_cp_hicache.__main__ import main

    return main(["simulate", "--no-progress", *with_engine(args)])


def _spelling(tmp_path, trace, how: str) -> str:
    if how == "same":
        return str(trace)
    if how == "relative":
        return os.path.relpath(trace)
    if how == "dotted":
        return str(tmp_path / "sub" / ".." / trace.name)
    link = tmp_path / f"{how}.jsonl"
    (os.symlink if how == "symlink" else os.link)(trace, link)
    return str(link)


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("how", ["same", "relative", "dotted", "symlink", "hardlink"])
def test_an_output_naming_the_trace_exits_2_and_leaves_it_alone(tmp_path, monkeypatch, capsys, no_launch, flag, how):
    (tmp_path / "sub").mkdir()
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    monkeypatch.chdir(tmp_path / "sub")
    out = _spelling(tmp_path, trace, how)
    assert run_cli("--trace", str(trace), flag, out) == 2
    err = capsys.readouterr().err
    assert f"error: --trace and {flag} name the same file: {out}" in err, err
    assert trace.read_text() == TRACE


def test_json_and_plot_hard_linked_to_one_file_exit_2(tmp_path, capsys, no_launch):
    first = tmp_path / "out.json"
    first.write_text("old")
    os.link(first, tmp_path / "out.png")
    assert run_cli("--json", str(first), "--plot", str(tmp_path / "out.png")) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err
    assert first.read_text() == "old"


def test_distinct_paths_pass(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    check_output_paths({"--json": str(tmp_path / "s.json"), "--plot": str(tmp_path / "s.png")},
                       inputs={"--trace": str(trace)})
    check_output_paths({"--json": str(trace) + ".json"}, inputs={"--trace": str(trace)})
    with pytest.raises(OutputPathError, match="^--trace and --json name the same file"):
        check_output_paths({"--json": str(trace)}, inputs={"--trace": str(trace)})
    assert sorted(os.listdir(tmp_path)) == ["t.jsonl"]
