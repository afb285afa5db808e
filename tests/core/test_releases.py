"""Which plugin serves which SGLang release, SGLANG_PLUGINS read as SGLang
reads it, and what a plugin says on a release that is not its own."""

import pathlib
import tomllib

import pytest

from sglang_cp_hicache import releases, settings

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_release_table_names_the_declared_entry_points():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert {r.plugin for r in releases.RELEASES} == set(declared)
    for r in releases.RELEASES:
        module = declared[r.plugin].split(":")[0]
        adapter = "sglang_" + r.sglang_version.replace(".", "")  # 0.5.18 -> sglang_0518
        assert module == f"sglang_cp_hicache.{adapter}.plugin", (r, module)
        # the adapter's own pin and plugin name are the table's
        source = (ROOT / "sglang_cp_hicache" / adapter / "plugin.py").read_text()
        assert f'PLUGIN_NAME = "{r.plugin}"' in source, adapter
        init = (ROOT / "sglang_cp_hicache" / adapter / "__init__.py").read_text()
        assert f'SUPPORTED_SGLANG = "{r.sglang_version}"' in init, adapter


@pytest.mark.parametrize(
    "value, allowed",
    [
        (None, None),
        ("", None),
        ("cp_hicache_0523", {"cp_hicache_0523"}),
        (" cp_hicache , other ,", {"cp_hicache", "other"}),
        (",", set()),   # set, but no name: SGLang loads no plugin at all
        ("   ", set()),
    ],
)
def test_the_allow_list_is_read_as_sglang_reads_it(value, allowed):
    env = {} if value is None else {"SGLANG_PLUGINS": value}
    got = releases.allowed_plugins(env)
    assert got == (None if allowed is None else frozenset(allowed))
    for plugin in ("cp_hicache", "cp_hicache_0523"):
        assert releases.plugin_allowed(plugin, env) == (allowed is None or plugin in allowed)


def test_a_left_out_plugin_is_named_with_the_fix():
    assert releases.left_out_warning("cp_hicache_0523", {}) is None
    text = releases.left_out_warning("cp_hicache_0523", {"SGLANG_PLUGINS": "cp-hicache_0523"})
    assert "SGLANG_PLUGINS='cp-hicache_0523' leaves out 'cp_hicache_0523'" in text
    assert "SGLang 0.5.23" in text and "add cp_hicache_0523 to SGLANG_PLUGINS or unset it" in text


def test_each_plugin_names_the_one_that_serves_the_running_release():
    warn, text = releases.not_my_release("cp_hicache", "0.5.23", {})
    assert not warn and "the plugin cp_hicache_0523 serves it" in text and "ALLOW_ANY" not in text
    warn, text = releases.not_my_release("cp_hicache_0523", "0.5.18", {})
    assert not warn and "the plugin cp_hicache serves it" in text and "--radix-cache-backend cp-hicache" in text
    # that plugin left out by the allow-list: a warning naming it
    warn, text = releases.not_my_release("cp_hicache", "0.5.23", {"SGLANG_PLUGINS": "cp_hicache"})
    assert warn and "leaves out 'cp_hicache_0523'" in text


def test_a_release_nobody_serves_is_a_warning():
    warn, text = releases.not_my_release("cp_hicache", "0.5.30", {})
    assert warn and "SGLang 0.5.30 has no adapter in this package (it serves 0.5.18, 0.5.23)" in text


def test_the_allow_list_is_shown_with_the_settings():
    assert settings.SGLANG_PLUGINS in settings.SETTINGS and settings.SGLANG_PLUGINS.is_free_form
    assert "SGLANG_PLUGINS=" in settings.describe({})


def test_settings_warns_when_the_allow_list_leaves_out_the_installed_release_s_plugin():
    import importlib.metadata
    import os
    import subprocess
    import sys

    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert releases.allow_list_note(None, {"SGLANG_PLUGINS": "x"}) is None
    assert releases.allow_list_note("0.5.30", {"SGLANG_PLUGINS": "x"}) is None
    assert "leaves out 'cp_hicache_0523'" in releases.allow_list_note("0.5.23", {"SGLANG_PLUGINS": "cp_hicache"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    typo = subprocess.run([sys.executable, "-m", "sglang_cp_hicache", "settings"],
                          env={**env, "SGLANG_PLUGINS": "cp-hicache"}, capture_output=True, text=True, timeout=120)
    assert typo.returncode == 0, typo.stderr
    adapter = releases.adapter_for(installed) if installed else None
    if adapter is None:
        assert "warning:" not in typo.stdout
    else:
        assert f"warning: sglang-cp-hicache: SGLANG_PLUGINS='cp-hicache' leaves out '{adapter.plugin}'" in typo.stdout
    fine = subprocess.run([sys.executable, "-m", "sglang_cp_hicache", "settings"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert fine.returncode == 0 and "warning:" not in fine.stdout
