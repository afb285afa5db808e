"""Everything the CLI can check is checked before any rank starts: output
paths, timeouts (exit status 2); a run that verified nothing fails unless
explicitly allowed."""

from __future__ import annotations

import json
import os

import pytest

from sglang_cp_hicache.sim import launcher
from sglang_cp_hicache.sim.config import MAX_TIMEOUT_S, SimConfig, default_startup_timeout_s
from sglang_cp_hicache.sim.outputs import OutputPathError, check_output_path
from sglang_cp_hicache.sim.records import AckCounts, EngineTotals, RankReport, RequestRecord
from sglang_cp_hicache.sim.report import summarize
from sglang_cp_hicache.sim.table import format_table
from tests.sim.simrun import simulate, with_engine


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a rank was launched"))


def run_cli(*args: str) -> int:
    from sglang_cp_hicache.__main__ import main

    return main(["simulate", "--no-progress", *with_engine(args)])


def unwritable_dir(tmp_path) -> str:
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses everyone
        return "/sys"
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o500)
    return str(path)


# ---------------------------------------------------------------------------
# --json / --plot
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("case", ["missing-dir", "parent-is-a-file", "is-a-directory", "unwritable"])
def test_unusable_output_paths_exit_2_before_launch(tmp_path, capsys, no_launch, flag, case):
    (tmp_path / "file").write_text("x")
    path, needle = {
        "missing-dir": (tmp_path / "nope" / "out", f"the directory {tmp_path / 'nope'} does not exist"),
        "parent-is-a-file": (tmp_path / "file" / "out", f"the directory {tmp_path / 'file'} is not a directory"),
        "is-a-directory": (tmp_path, "is a directory, expected a file path"),
        "unwritable": (os.path.join(unwritable_dir(tmp_path), "out"), "cannot write there: Permission denied"),
    }[case]
    assert run_cli(flag, str(path)) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} {path}: " in err and needle in err, err


def test_json_and_plot_may_not_name_one_file(tmp_path, capsys, no_launch):
    out = str(tmp_path / "out")
    assert run_cli("--json", out, "--plot", out) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err


def test_a_writable_path_passes_and_the_check_leaves_nothing_behind(tmp_path):
    check_output_path("--json", str(tmp_path / "new.json"))
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    check_output_path("--json", str(existing))
    assert sorted(os.listdir(tmp_path)) == ["old.json"] and existing.read_text() == "kept"
    with pytest.raises(OutputPathError, match="expected a file path"):
        check_output_path("--json", "")


# ---------------------------------------------------------------------------
# Timeouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--collective-timeout", "--startup-timeout"])
@pytest.mark.parametrize(
    "value, needle",
    [
        ("inf", "must be at most 86400 s (one day), got inf"),
        ("1e15", "must be at most 86400 s (one day), got 1e+15"),
        ("86400.5", "must be at most 86400 s"),
        ("nan", "must be a number of seconds, got nan"),
        ("-1", "must be > 0, got -1"),
        ("0", "must be > 0, got 0"),
        ("soon", "must be a number of seconds, got 'soon'"),
    ],
)
def test_timeouts_are_finite_and_bounded_at_parse_time(capsys, no_launch, flag, value, needle):
    with pytest.raises(SystemExit) as exc:
        run_cli(flag, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {needle}" in err, err


def test_sim_config_rejects_unusable_timeouts():
    for name in ("collective_timeout_s", "startup_timeout_s", "grace_s"):
        for bad in (float("inf"), float("nan"), 0.0, -3.0, MAX_TIMEOUT_S * 2):
            with pytest.raises(ValueError, match=name):
                SimConfig(**{name: bad})
        with pytest.raises(TypeError, match=name):
            SimConfig(**{name: "60"})


def test_startup_timeout_scales_with_cp_size_or_is_the_flag(captured_launch):
    assert default_startup_timeout_s(2) == 180.0 and default_startup_timeout_s(8) == 360.0
    assert SimConfig(cp_size=8).startup_limit_s == 360.0
    assert run_cli("--cp-size", "8", "--requests", "2") == 1
    assert run_cli("--requests", "2", "--startup-timeout", "42.5") == 1
    assert [c.startup_limit_s for c in captured_launch] == [360.0, 42.5]
    assert captured_launch[1].collective_timeout_s == 60.0


# ---------------------------------------------------------------------------
# Nothing verified
# ---------------------------------------------------------------------------


def _report(rank: int, verified: int) -> RankReport:
    records = [RequestRecord(index=i, tokens=40, verified_pages=verified if i == 0 else 0) for i in range(3)]
    return RankReport(
        rank=rank, cp_size=2, cp_mode=True, records=records,
        totals=EngineTotals(tree_digest="d", host_slot_capacity=1024), acks=AckCounts(3, 0, 3, 0),
        cpu_seconds=0.1, cache_cpu_seconds=0.05, content_cpu_seconds=0.01, collective_cpu_seconds=0.01,
        collective_calls=6, wall_seconds=0.2, startup_seconds=4.0,
        agreement={"digests_agree": True, "acks_agree": True} if rank == 0 else None,
    )


def _summary(verified: int, allow: bool):
    cp = launcher.LaunchResult(label="CP2", reports=[_report(0, verified), _report(1, 0)], exit_codes={0: 0, 1: 0})
    return summarize(SimConfig(), "trace:t", 3, cp, None, allow_unverified=allow)


def test_a_run_that_verified_nothing_fails_unless_allowed():
    summary, verdict = _summary(0, allow=False)
    assert not verdict.ok and summary["nothing_verified"] and not summary["ok"]
    assert any("no page was verified" in p and "--allow-unverified" in p for p in verdict.problems)
    assert "result: FAILED: no page was verified" in format_table(summary)

    summary, verdict = _summary(0, allow=True)
    assert verdict.ok and summary["ok"] and summary["nothing_verified"]
    assert format_table(summary).splitlines()[-1].startswith("result: OK, but NOTHING WAS VERIFIED: ")

    summary, verdict = _summary(2, allow=False)
    assert verdict.ok and not summary["nothing_verified"]
    assert format_table(summary).splitlines()[-1] == "result: OK"


@pytest.mark.slow(10)
def test_a_trace_of_sub_page_requests_exits_1_saying_nothing_was_verified(tmp_path):
    trace = tmp_path / "short.jsonl"
    trace.write_text("".join(json.dumps({"tokens": [7] * n}) + "\n" for n in (10, 20, 30, 40, 63)))
    out = tmp_path / "sim.json"
    proc, _ = simulate("--cp-size", "2", "--trace", str(trace), "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "result: FAILED: no page was verified" in proc.stdout
    assert "pages verified bit-exact: 0 " in proc.stdout
    s = json.loads(out.read_text())
    assert s["verified_pages"] == 0 and s["nothing_verified"] and not s["ok"]


# ---------------------------------------------------------------------------
# --sglang / --copy / --non-cp-group
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--copy", "upstream"], "needs SGLang 0.5.23"),
        (["--sglang", "0.5.23"], "separate venvs"),
        (["--non-cp-group", "ring"], "invalid choice"),
        (["--l3", "mooncake://nohost"], "--l3 mooncake://nohost: expected mooncake://HOST:PORT"),
        (["--mooncake-segment", "64mb"], "--mooncake-segment needs --l3 mooncake://HOST:PORT"),
        (["--l3", "mooncake://127.0.0.1:5", "--mooncake-segment", "8mb"], "--mooncake-segment must be at least"),
    ],
)
def test_release_and_copy_path_flags_are_checked_before_launch(capsys, no_launch, args, message):
    try:
        code = run_cli(*args)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_mooncake_l3_reaches_the_config_as_a_master_and_a_segment_per_rank(captured_launch):
    assert run_cli("--l3", "mooncake://127.0.0.1:5", "--mooncake-segment", "32mb") == 1
    (config,) = captured_launch
    assert (config.l3_mooncake, config.mooncake_segment_bytes, config.l3_dir) == ("127.0.0.1:5", 32 << 20, None)
    assert config.l3_label == "mooncake://127.0.0.1:5"


def test_a_mooncake_l3_without_the_wheel_is_refused_naming_the_flag(capsys, no_launch, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec  # this environment without the mooncake wheel (as .venv-0523 is)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else find_spec(name, *a))
    assert run_cli("--l3", "mooncake://127.0.0.1:5") == 2
    assert "--l3 mooncake://127.0.0.1:5: this environment" in capsys.readouterr().err


def test_release_is_auto_detected_and_the_baseline_group_reaches_the_config(captured_launch):
    assert run_cli("--compare-non-cp", "--non-cp-group", "single") == 1
    (config,) = captured_launch
    assert config.sglang_version == "0.5.18" and config.copy_path == "library"
    assert config.non_cp_group == "single" and config.non_cp_ranks == 1
    assert SimConfig(cp_size=4).non_cp_ranks == 4  # the TP baseline is the default


def test_summary_reports_copies_and_all_reduces_per_request():
    reports = []
    for rank in range(2):
        totals = EngineTotals(tree_digest="d")
        rep = RankReport(rank=rank, cp_size=2, cp_mode=True, records=[RequestRecord(0, 64, verified_pages=1)],
                         totals=totals, acks=AckCounts(), cpu_seconds=1.0, cache_cpu_seconds=0.5,
                         content_cpu_seconds=0.2, collective_cpu_seconds=0.1, collective_calls=3,
                         wall_seconds=1.0, startup_seconds=1.0,
                         agreement={"digests_agree": True, "acks_agree": True} if rank == 0 else None,
                         copies={"backend": "reference", "cp_size": 2, "kv_backup_calls": 2, "kv_load_calls": 1,
                                 "indexer_backup_calls": 2, "indexer_load_calls": 1, "pages_copied": 4})
        reports.append(rep)
    baseline = []
    for rank in (-1, -2):
        baseline.append(RankReport(rank=rank, cp_size=1, cp_mode=False, records=[RequestRecord(0, 64, verified_pages=1)],
                                   totals=EngineTotals(tree_digest="n"), acks=AckCounts(), cpu_seconds=2.0,
                                   cache_cpu_seconds=0.4, content_cpu_seconds=1.0, collective_cpu_seconds=0.1,
                                   collective_calls=2, wall_seconds=1.0, startup_seconds=1.0))
    cp = launcher.LaunchResult(label="CP2", reports=reports, exit_codes={0: 0, 1: 0})
    nc = launcher.LaunchResult(label="non-CP", reports=baseline, exit_codes={-1: 0, -2: 0})
    summary, verdict = summarize(SimConfig(cp_size=2), "synthetic-chat", 2, cp, nc)
    assert verdict.ok, verdict.problems
    assert summary["copies"]["cp_size"] == 2 and summary["copies"]["kv_backup_calls"] == 4
    assert summary["all_reduces_per_request"] == {"cp": 1.5, "non_cp": 1.0}
    assert summary["cache_cpu_ratio"] == pytest.approx(0.5 / 0.4)
    assert summary["non_cp_group"].startswith("tp") and summary["non_cp"]["processes"] == 2
    assert summary["sglang_version"] == "0.5.18" and summary["indexer_pages_verified"] == 0
    assert "all-reduces per request per rank: CP 1.500, non-CP 1.000" in format_table(summary)
