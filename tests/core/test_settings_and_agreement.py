"""The settings module (every variable, unknown values refused with the
valid ones) and the start-up agreement check (each kind of mismatch named)."""

from dataclasses import asdict

import pytest

from sglang_cp_hicache import settings
from sglang_cp_hicache.agreement import CpAgreementError, RankView, check_agreement, gather_and_check

from tests.helpers.gloo_gather import agreement_on_threads, object_all_gather


@pytest.mark.parametrize("setting", settings.SETTINGS, ids=lambda s: s.name)
def test_every_setting_has_its_default_when_unset_or_empty(setting):
    assert settings.read(setting, {}) == setting.default
    assert settings.read(setting, {setting.name: "  "}) == setting.default


@pytest.mark.parametrize("setting", [s for s in settings.SETTINGS if s.choices], ids=lambda s: s.name)
def test_an_unknown_value_is_refused_with_the_valid_ones(setting):
    with pytest.raises(ValueError) as err:
        settings.read(setting, {setting.name: "libary"})
    msg = str(err.value)
    assert setting.name in msg and "'libary'" in msg
    assert all(c in msg for c in setting.choices)


def test_values_are_trimmed_and_case_insensitive():
    assert settings.read(settings.COPY, {settings.COPY.name: " Upstream "}) == "upstream"
    assert settings.enabled(settings.DEBUG, {settings.DEBUG.name: "ON"})
    assert not settings.enabled(settings.DEBUG, {settings.DEBUG.name: "0"})


def test_a_free_form_setting_is_trimmed_and_keeps_its_case():
    free = [s for s in settings.SETTINGS if s.is_free_form]
    # directories, the operator's model id, SGLang's file-backend bounds, SGLang's plugin allow-list and
    # SGLang's / Mooncake's own variables (read as SGLang reads them, only for the backend that uses them);
    # every other setting has choices or is a number
    assert free == [settings.L3_DIR, settings.L3_MODEL_ID, settings.L3_KEY_FILE, settings.SGLANG_FILE_DIR,
                    settings.FILE_MAX_SIZE, settings.FILE_MIN_FREE, settings.FILE_EVICTION_RATIO,
                    settings.HF_HUB_CACHE, settings.HF_HOME, settings.HUGGINGFACE_HUB_CACHE, settings.XDG_CACHE_HOME,
                    settings.SGLANG_PLUGINS, *settings.MOONCAKE_SETTINGS]
    assert not settings.L3_DIR.is_flag
    env = {settings.L3_DIR.name: "  /Data/L3 Dir/ "}
    assert settings.read(settings.L3_DIR, env) == "/Data/L3 Dir/"
    assert settings.check_all(env)[settings.L3_DIR.name] == "/Data/L3 Dir/"
    assert settings.read(settings.L3_DIR, {}) == ""
    assert "any text" in settings.describe({})
    with pytest.raises(TypeError, match="SGLANG_CP_HICACHE_L3_DIR"):
        settings.enabled(settings.L3_DIR, {})


def test_check_all_reads_every_setting_and_stops_at_a_bad_one():
    assert set(settings.check_all({})) == {s.name for s in settings.SETTINGS}
    with pytest.raises(ValueError, match="SGLANG_CP_HICACHE_HOST_BALANCE"):
        settings.check_all({settings.HOST_BALANCE.name: "fair"})


def test_enabled_refuses_a_non_flag():
    with pytest.raises(TypeError, match="SGLANG_CP_HICACHE_COPY"):
        settings.enabled(settings.COPY, {})


def test_describe_lists_every_variable_and_marks_an_invalid_value():
    text = settings.describe({settings.COPY.name: "nope"})
    assert all(s.name in text for s in settings.SETTINGS)
    assert "INVALID: nope" in text


def test_the_cli_shows_the_settings_and_fails_on_a_bad_one():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_CP_HICACHE_")}
    ok = subprocess.run([sys.executable, "-m", "sglang_cp_hicache", "settings", "--all"], env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert all(f"{s.name}={s.default}" in ok.stdout for s in settings.SETTINGS)
    bad = subprocess.run([sys.executable, "-m", "sglang_cp_hicache", "settings"],
                         env={**env, settings.HOST_BALANCE.name: "fair"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "SGLANG_CP_HICACHE_HOST_BALANCE='fair' is not valid" in bad.stderr


def test_every_environment_read_of_the_package_goes_through_settings():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    # A read: .get / getenv / a subscript that is not the target of an
    # assignment (the simulator sets a setting for its rank processes).
    reads = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]*\](?!\s*=[^=])")
    # sim/config.py: its test hook; sim/extensions.py: torch's TORCH_EXTENSIONS_DIR (and the cache home it
    # defaults under), extended per SGLang release for the processes the simulator starts, no setting of ours
    allowed = {"sglang_cp_hicache/settings.py", "sglang_cp_hicache/sim/config.py", "sglang_cp_hicache/sim/extensions.py"}
    found = [
        p.relative_to(root).as_posix()
        for base in ("sglang_cp_hicache", "kernels")
        for p in (root / base).rglob("*.py")
        if p.relative_to(root).as_posix() not in allowed
        and not p.relative_to(root).as_posix().startswith("sglang_cp_hicache/testing/")
        and reads.search(p.read_text())
    ]
    assert found == []


# ---- agreement ----------------------------------------------------------------
def views(n):
    return [RankView(r, n, {"page_size": 64, "host_layout": "page_first"}) for r in range(n)]


def test_agreeing_ranks_pass():
    check_agreement(views(4))
    check_agreement(list(reversed(views(4))))  # gather order need not be cp_rank order


def test_a_different_value_names_the_rank_and_both_values():
    with pytest.raises(CpAgreementError, match=r"host_layout: cp_rank 2 has 'layer_first', cp_rank 0 has 'page_first'"):
        check_agreement(_with(views(4), 2, "host_layout", "layer_first"))


def _with(vs, rank, key, value):
    vs = list(vs)
    vs[rank] = RankView(vs[rank].cp_rank, vs[rank].cp_size, {**vs[rank].values, key: value})
    return vs


def test_a_missing_value_is_a_difference():
    vs = views(2)
    vs[1] = RankView(1, 2, {"page_size": 64})
    with pytest.raises(CpAgreementError, match="host_layout: cp_rank 1 has None"):
        check_agreement(vs)


def test_a_different_cp_size_is_named():
    vs = views(2)
    vs[1] = RankView(1, 4, vs[1].values)
    with pytest.raises(CpAgreementError, match="cp_size: group rank 1 \\(cp_rank 1\\) has 4"):
        check_agreement(vs)


def test_duplicate_missing_and_out_of_range_ranks():
    vs = views(3)
    vs[2] = RankView(1, 3, vs[2].values)
    with pytest.raises(CpAgreementError, match="cp_rank 1 is claimed by group ranks 1 and 2"):
        check_agreement(vs)
    vs[2] = RankView(5, 3, vs[2].values)
    with pytest.raises(CpAgreementError, match="cp_rank 5, outside 0..2"):
        check_agreement(vs)
    with pytest.raises(CpAgreementError, match="has 2 ranks but cp_size is 3"):
        check_agreement(views(3)[:2])


def test_a_lone_rank_without_a_group_checks_only_itself():
    assert gather_and_check(RankView(1, 4, {"x": 1}), None) == [RankView(1, 4, {"x": 1})]
    with pytest.raises(CpAgreementError, match="outside 0..3"):
        gather_and_check(RankView(4, 4, {}), None)


@pytest.mark.parametrize("case", ["agree", "policy", "duplicate_rank"])
def test_every_rank_of_a_real_group_gets_the_same_verdict(case):
    """Three ranks as threads on a real gloo group, one all-gather each."""

    def run(r, pg):
        cp_rank = 0 if (case == "duplicate_rank" and r == 2) else r
        view = RankView(cp_rank, 3, {"policy": "greedy" if (case == "policy" and r == 2) else "exact"})
        gather_and_check(view, pg, all_gather=object_all_gather)

    results = agreement_on_threads(case, run)
    expected = {
        "agree": "ok",
        "policy": "CP ranks disagree on policy: cp_rank 2 has 'greedy', cp_rank 0 has 'exact'; "
        "start every rank with the same policy",
        "duplicate_rank": "cp_rank 0 is claimed by group ranks 0 and 2; each rank of the CP group "
        "needs its own cp_rank in 0..2",
    }[case]
    assert results == {0: expected, 1: expected, 2: expected}


def test_a_hint_is_added_to_a_disagreement_on_its_key_only():
    from sglang_cp_hicache.agreement import COPY_PATH_KEY

    views = [RankView(0, 2, {COPY_PATH_KEY: "library"}), RankView(1, 2, {COPY_PATH_KEY: "upstream"})]

    def gather(out, obj, group):  # stands in for all_gather_object: rank 1's view is the odd one
        out[:] = [asdict(v) for v in views]

    group = type("G", (), {"size": lambda self: 2})()
    with pytest.raises(CpAgreementError, match="start every rank with the same copy_path; set X$"):
        gather_and_check(views[0], group, all_gather=gather, hints={COPY_PATH_KEY: "set X"})
    with pytest.raises(CpAgreementError, match="start every rank with the same copy_path$"):
        gather_and_check(views[0], group, all_gather=gather, hints={"page_size": "set Y"})


def test_a_page_size_disagreement_is_named_before_the_sizes_that_follow_from_it():
    views = [RankView(0, 2, {"page_size": 64, "host_pool_slots": 1088}),
             RankView(1, 2, {"page_size": 32, "host_pool_slots": 544})]
    with pytest.raises(CpAgreementError, match="disagree on page_size: cp_rank 1 has 32, cp_rank 0 has 64"):
        check_agreement(views)
    views[1] = RankView(1, 2, {"page_size": 64, "host_pool_slots": 544, "a_key": 1})
    with pytest.raises(CpAgreementError, match="disagree on a_key:"):
        check_agreement(views)
