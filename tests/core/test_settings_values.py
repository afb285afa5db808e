"""Issue 43: no setting fails after start-up. Sizes, ratios and flags SGLang
parses are parsed before any rank starts, as SGLang parses them; a misspelt
``SGLANG_CP_HICACHE_*`` name is warned of with the closest name; ``settings``
names the installed SGLang and the plugin that will load."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from decimal import Decimal

import pytest

from sglang_cp_hicache import releases, settings, sizes
from sglang_cp_hicache.l3.capacity import CapacityConfig
from sglang_cp_hicache.sim.config import FAIL_ENV
from tests.helpers.sglang_parsers import sglang_file_size, sglang_parsers

#: Sizes around every edge of SGLang's human_readable_int and int().
SIZES = ["0", "", " 7 ", "1048576", "+5", "1_000", "-5", "1.5", "1e9", "200G", "1.5T", "64Gi", "1.5Gi", "25.6k",
         "4.35G", "0.1k", "3Mi", "100gb", "100GB", "5 G", "5g", "1K", "ten", "G", "1Ki ", "\u0661\u0662"]


def test_file_sizes_are_accepted_exactly_as_sglang_reads_them_or_refused():
    parsers = sglang_parsers()
    if parsers is None:
        pytest.skip("SGLang is not installed")
    for text in SIZES:
        theirs = sglang_file_size(parsers, text)
        try:
            ours = sizes.parse_file_size("max_size", text)
        except ValueError as exc:
            assert "200G" in str(exc) and "64Gi" in str(exc), exc  # refused naming SGLang's forms
            # refused: SGLang could not read it either, or read a negative as "no bound"
            assert theirs is None or int(text.replace("_", "")) < 0, (text, theirs)
            continue
        assert ours == theirs, (text, ours, theirs)


def test_si_decimals_are_exact_as_sglang_s_decimal():
    assert sizes.parse_file_size("x", "4.35G") == int(Decimal("4.35") * 10**9) == 4_350_000_000


@pytest.mark.parametrize("value", ["0.5", "1", " 0.9 ", "1e-1"])
def test_ratios_sglang_reads(value):
    assert sizes.parse_eviction_ratio("r", value) == float(value)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan", "lots", True])
def test_ratios_sglang_would_replace_by_0_9_are_refused(value):
    with pytest.raises(ValueError, match=r"r must be a number in \(0, 1\]"):
        sizes.parse_eviction_ratio("r", value)


@pytest.mark.parametrize("name,value,forms", [
    (settings.FILE_MAX_SIZE.name, "lots", "64Gi"), (settings.FILE_MIN_FREE.name, "10 GB", "200G"),
    (settings.FILE_EVICTION_RATIO.name, "high", "(0, 1]"), (settings.MOONCAKE_SEGMENT_SIZE.name, "4 gigs", "4gb"),
    (settings.MOONCAKE_SEGMENT_SIZE.name, "0", "4gb"), (settings.MOONCAKE_SSD_OFFLOAD.name, "maybe", "true/1"),
    (settings.MOONCAKE_STANDALONE_STORAGE.name, "on", "false/0"),
])
def test_check_all_refuses_a_bad_size_ratio_or_flag_naming_it_and_the_forms(name, value, forms):
    with pytest.raises(ValueError) as err:
        settings.check_all({name: value})
    assert f"{name}={value.strip()!r} is not valid; use" in str(err.value) and forms in str(err.value)


def test_check_all_keeps_good_sizes_as_written_and_the_capacity_reads_them_alike():
    env = {settings.FILE_MAX_SIZE.name: " 64Gi ", settings.FILE_MIN_FREE.name: "1.5T",
           settings.FILE_EVICTION_RATIO.name: "0.5", settings.MOONCAKE_SEGMENT_SIZE.name: "4GB",
           settings.MOONCAKE_SSD_OFFLOAD.name: "Y"}
    values = settings.check_all(env)
    assert values[settings.FILE_MAX_SIZE.name] == "64Gi"
    assert CapacityConfig.from_sources({}, values, "lru-leaves") == CapacityConfig(64 * 2**30, 1_500_000_000_000, 0.5)


def test_a_misspelt_name_gets_the_closest_valid_one_and_known_names_none():
    env = {"SGLANG_CP_HICACHE_L3_THREDS": "3", "SGLANG_CP_HICACHE_ZZZ": "1", settings.COPY.name: "library",
           FAIL_ENV: "1", "SGLANG_OTHER": "x"}
    found = settings.unknown_names(env)
    assert found == [
        "SGLANG_CP_HICACHE_L3_THREDS is not a setting of sglang-cp-hicache and is ignored; "
        "did you mean SGLANG_CP_HICACHE_L3_THREADS?",
        "SGLANG_CP_HICACHE_ZZZ is not a setting of sglang-cp-hicache and is ignored; "
        "python -m sglang_cp_hicache settings --all lists them",
    ]
    settings.check_all(env)  # warned, never refused


def test_the_adapters_log_a_misspelt_name_once(caplog):
    log = logging.getLogger("test.unknown")
    env = {"SGLANG_CP_HICACHE_HOST_BALANSE": "exact"}
    with caplog.at_level(logging.WARNING, logger="test.unknown"):
        first = settings.log_unknown_names(log, env)
        again = settings.log_unknown_names(log, env)
    assert again == [] and len(first) == 1
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "did you mean SGLANG_CP_HICACHE_HOST_BALANCE?" in caplog.records[0].getMessage()


def test_both_adapters_log_unknown_names_where_they_check_the_settings():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for rel in ("sglang_cp_hicache/sglang_0518/hiradix.py", "sglang_cp_hicache/sglang_0523/startup.py"):
        text = open(os.path.join(root, rel)).read()
        assert "settings.check_all()" in text and "settings.log_unknown_names(logger)" in text, rel


@pytest.mark.parametrize("version,plugins,env,line", [
    (None, frozenset(), {}, "SGLang is not installed here: no plugin of this package loads"),
    ("0.5.30", frozenset({"cp_hicache"}), {}, "SGLang 0.5.30 installed: no plugin of this package serves it"),
    ("0.5.23", frozenset({"cp_hicache", "cp_hicache_0523"}), {},
     "SGLang 0.5.23 installed: plugin cp_hicache_0523 will load (SGLANG_PLUGINS unset: every installed plugin "
     "loads)"),
    ("0.5.18", frozenset({"cp_hicache"}), {"SGLANG_PLUGINS": "x, cp_hicache"},
     "SGLang 0.5.18 installed: plugin cp_hicache will load (SGLANG_PLUGINS='x, cp_hicache' names it)"),
    ("0.5.23", frozenset({"cp_hicache_0523"}), {"SGLANG_PLUGINS": "cp_hicache"},
     "SGLang 0.5.23 installed: plugin cp_hicache_0523 will NOT load (SGLANG_PLUGINS='cp_hicache' leaves it out)"),
    ("0.5.18", frozenset(), {}, "SGLang 0.5.18 installed: plugin cp_hicache will not load (its entry point is not"),
])
def test_the_plugin_line(version, plugins, env, line):
    assert releases.plugin_line(version, plugins, env).startswith(line)


def _run(monkeypatch, capsys, *args: str, **env: str) -> tuple[int, str, str]:
    """The CLI in this process (a subprocess spends seconds importing torch; the
    exit status and output are the same): only ``env`` of SGLang's / our variables set."""
    from sglang_cp_hicache.__main__ import main

    for name in list(os.environ):
        if name.startswith(("SGLANG_", "MOONCAKE_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_settings_names_the_release_and_plugin_shows_only_what_is_set_and_warns_of_a_typo(monkeypatch, capsys):
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    plugins = frozenset(ep.name for ep in importlib.metadata.entry_points(group="sglang.srt.plugins"))
    code, out, err = _run(monkeypatch, capsys, "settings", SGLANG_CP_HICACHE_COPY="upstream",
                          SGLANG_CP_HICACHE_L3_THREDS="2")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == releases.plugin_line(installed, plugins, {})
    if installed in ("0.5.18", "0.5.23"):  # each venv: its own release's plugin
        plugin = releases.adapter_for(installed).plugin
        assert lines[0].startswith(f"SGLang {installed} installed: plugin {plugin} will load"), lines[0]
    assert "SGLANG_CP_HICACHE_COPY=upstream" in out and "SGLANG_CP_HICACHE_HOST_BALANCE" not in out
    assert f"({len(settings.SETTINGS) - 1} other settings at their defaults; --all shows every one)" in out
    assert len(lines) < 10, out
    assert "warning: SGLANG_CP_HICACHE_L3_THREDS is not a setting of sglang-cp-hicache and is ignored; did you " \
           "mean SGLANG_CP_HICACHE_L3_THREADS?" in out
    code, everything, _ = _run(monkeypatch, capsys, "settings", "--all")
    assert code == 0 and all(f"{s.name}=" in everything for s in settings.SETTINGS)


def test_settings_exits_2_on_a_bad_size_naming_the_variable_and_sglang_s_forms(monkeypatch, capsys):
    code, out, err = _run(monkeypatch, capsys, "settings", SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE="lots")
    assert code == 2
    assert "error: SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE='lots' is not valid; use bytes (1048576)" in err
    assert "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE=INVALID: lots" in out


def test_simulate_refuses_a_bad_size_before_any_rank_starts_in_one_line(monkeypatch, capsys, tmp_path):
    l3 = tmp_path / "l3"
    started = time.monotonic()
    code, out, err = _run(monkeypatch, capsys, "simulate", "--l3", str(l3), "--no-progress",
                          SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE="100gb")
    took = time.monotonic() - started
    assert code == 2, err
    assert took < 5, took  # the checks only: no rank was spawned (each spends ~15 s starting)
    errors = [line for line in err.splitlines() if line.strip()]
    assert errors == ["sglang-cp-hicache simulate: error: SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE='100gb' is not "
                      f"valid; use {sizes.FILE_SIZE_FORMS}"], err
    assert not l3.exists()  # refused before --l3's directory is created
