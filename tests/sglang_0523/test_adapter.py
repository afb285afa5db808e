"""The 0.5.23 adapter: start-up refusals, the plugin entry point, argument checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sglang
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.sglang_0523 import ALLOW_ANY_ENV, SUPPORTED_SGLANG, check_sglang_version, plugin, strategy
from sglang_cp_hicache.sglang_0523.copy_engine import LibraryL2TransferEngine
from sglang_cp_hicache.sglang_0523.strategy import LibraryDsaStrategy, LibraryStackError, UpstreamDsaStrategy

from tests.helpers.plugin_loading import assert_loaded_as_allowed


# ---- start-up check on real stacks (two rank processes) ----------------------


def test_every_knocked_out_seam_refuses_start_up_by_name(two_ranks):
    names = {
        "prepare": "HybridCacheController._move_kv_shard_indices",
        "d2h": "L2TransferEngine.submit_device_to_host",
        "h2d": "L2TransferEngine.submit_host_to_device",
    }
    for rank, result in enumerate(two_ranks):
        refusals = result["refusals"]
        for knockout, name in names.items():
            assert name in refusals[knockout], (rank, knockout, refusals[knockout])
            assert "SGLANG_CP_HICACHE_COPY=upstream" in refusals[knockout]
        assert refusals["intact"] == "LibraryCopyController", rank


def _fake_stack(io_backend="kernel", layout="layer_first", drafts=()):
    result = SimpleNamespace(
        cache_controller=SimpleNamespace(io_backend=io_backend),
        host_pool_group=SimpleNamespace(layout=layout, entries=[]),
    )
    return result, SimpleNamespace(layer_shard_enabled=False), SimpleNamespace(mtp_draft_device_pools=drafts)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"io_backend": "direct"}, "io backend 'direct'"),
        ({"layout": "page_first_kv_split"}, "host layout 'page_first_kv_split'"),
        ({"drafts": (object(),)}, "packed MTP draft pools"),
    ],
)
def test_unsupported_stacks_are_refused_by_name(kwargs, words):
    with pytest.raises(LibraryStackError, match=words):
        strategy._check_supported(*_fake_stack(**kwargs))


# ---- registration -----------------------------------------------------------


def test_plugin_registers_the_strategy_first(strategies, monkeypatch):
    monkeypatch.delenv(plugin.COPY_ENV, raising=False)
    strategy.uninstall_strategy()
    plugin.register()
    assert isinstance(strategies[0], LibraryDsaStrategy) and strategy.strategy_installed()
    plugin.register()  # idempotent
    assert sum(isinstance(s, LibraryDsaStrategy) for s in strategies) == 1


def test_copy_env_upstream_registers_the_upstream_strategy_that_only_agrees(strategies, monkeypatch):
    """A rank on upstream's copy path still joins the start-up agreement (so a
    mixed deployment is refused instead of hanging); its build is upstream's
    own (test_upstream_stack_is_built_untouched checks the built stack)."""
    strategy.uninstall_strategy()
    monkeypatch.setenv(plugin.COPY_ENV, "upstream")
    plugin.register()
    assert type(strategies[0]) is UpstreamDsaStrategy and strategy.installed_copy_path() == "upstream"
    assert not any(isinstance(s, LibraryDsaStrategy) for s in strategies)
    plugin.register()  # idempotent
    assert sum(isinstance(s, UpstreamDsaStrategy) for s in strategies) == 1
    # switching the path in one process replaces it
    monkeypatch.delenv(plugin.COPY_ENV)
    plugin.register()
    assert type(strategies[0]) is LibraryDsaStrategy and strategy.installed_copy_path() == "library"
    assert not any(isinstance(s, UpstreamDsaStrategy) for s in strategies)


def test_copy_env_upstream_on_another_release_registers_nothing(strategies, monkeypatch):
    """The upstream strategy copies 0.5.23's build; elsewhere it stays out."""
    strategy.uninstall_strategy()
    before = list(strategies)
    monkeypatch.setenv(plugin.COPY_ENV, "upstream")
    monkeypatch.setenv(ALLOW_ANY_ENV, "1")
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    plugin.register()
    assert strategies == before and strategy.installed_copy_path() is None


def test_upstream_stack_is_built_untouched(two_ranks):
    """Built through the plugin's upstream strategy: upstream's classes, no
    method replaced on any instance, the same attributes as a stack built by
    upstream's own strategy, and the same bytes, locs and tree for the same
    requests."""
    for rank, result in enumerate(two_ranks):
        untouched = result["upstream_untouched"]
        for path in ("upstream", "via_plugin"):
            assert untouched[path]["types"] == {
                "controller": "HybridCacheController", "engine": "L2TransferEngine",
                "host_pool": "PageInterleaveHostPool",
            }, (rank, path)
            assert untouched[path]["replaced"] == [], (rank, path)
        assert untouched["upstream"]["attributes"] == untouched["via_plugin"]["attributes"], rank
        assert untouched["same_records"] and untouched["same_digest"], rank
        assert untouched["host_bytes_equal"] == [True, True] and untouched["device_bytes_equal"], rank
        assert untouched["same_nodes"], rank
        # one start-up line per stack built by the plugin's strategies names the copy path
        lines = untouched["copy_path_lines"]
        assert lines["upstream"] == [], rank  # upstream's own strategy: nothing of ours ran
        assert len(lines["via_plugin"]) == 1 and lines["via_plugin"][0].endswith(
            "Copy path: upstream (SGLANG_CP_HICACHE_COPY=upstream)"), (rank, lines)
        assert f"cp_rank {rank} of 2" in lines["via_plugin"][0], (rank, lines)
        assert len(lines["library"]) == 1 and lines["library"][0].endswith(
            "Copy path: library (SGLANG_CP_HICACHE_COPY=library)"), (rank, lines)
        # the library stack, built in the same process, does replace them
        assert sorted(untouched["library_replaced"]) == [
            "allocator.free", "allocator.free_group_end", "allocator.free_segment", "cache._execute_kv_backup",
            "cache.claim_kv_row", "cache.free_kv_row", "cache.insert", "cache.on_release", "full.evict_component",
        ], rank


def test_a_misspelt_copy_env_refuses_to_start_instead_of_falling_back(strategies, monkeypatch):
    """SGLang only logs a plugin that raises; a bad value must still stop the
    sharded stack at cache construction, naming the valid values."""
    strategy.uninstall_strategy()
    monkeypatch.setenv(plugin.COPY_ENV, "libary")
    plugin.register()  # does not raise: SGLang would only log it
    refusing = strategies[0]
    assert not isinstance(refusing, LibraryDsaStrategy)
    with pytest.raises(ValueError, match=r"SGLANG_CP_HICACHE_COPY='libary' is not valid; use one of: library, upstream"):
        refusing.build(cache=None, kvcache=None, params=None, server_args=None, load_cache_event=None)


def test_another_release_gets_a_strategy_that_refuses_to_build(strategies, monkeypatch):
    strategy.uninstall_strategy()
    monkeypatch.delenv(plugin.COPY_ENV, raising=False)
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    plugin.register()
    refusing = strategies[0]
    assert not isinstance(refusing, LibraryDsaStrategy)
    with pytest.raises(RuntimeError, match=r"supports sglang==0\.5\.23, found 0\.5\.24"):
        refusing.build(cache=None, kvcache=None, params=None, server_args=None, load_cache_event=None)


def test_version_pin(monkeypatch):
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    check_sglang_version(SUPPORTED_SGLANG)
    with pytest.raises(RuntimeError, match="found 0.5.18"):
        check_sglang_version("0.5.18")
    monkeypatch.setenv(ALLOW_ANY_ENV, "1")
    check_sglang_version("0.5.18")


def test_a_strategy_registered_ahead_of_ours_is_refused(strategies):
    strategy.install_strategy()
    assembler.register_stack_strategy(LibraryDsaStrategy())  # someone else's, first
    with pytest.raises(LibraryStackError, match="ahead of sglang-cp-hicache"):
        strategy.install_strategy()


# ---- arguments --------------------------------------------------------------


def test_engine_arguments():
    with pytest.raises(TypeError, match="placement must be a CpPlacement, got tuple"):
        LibraryL2TransferEngine("kernel", (64, 2, 0))
    with pytest.raises(ValueError, match="io_backend must be 'kernel'"):
        LibraryL2TransferEngine("direct", CpPlacement(64, 2, 0))


# ---- each plugin's words on the release it runs on -----------------------------


def test_the_0518_plugin_on_0523_points_to_this_release_s_plugin(monkeypatch, caplog):
    """SGLang 0.5.23 loads the 0.5.18 entry point too: it must import here,
    register nothing, and name the plugin that serves 0.5.23 -- never advise
    SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG, which is wrong on this release."""
    from sglang.srt.mem_cache import registry

    from sglang_cp_hicache.sglang_0518 import plugin as plugin_0518

    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    before = registry.registered_radix_cache_backends()
    with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0518.plugin"):
        plugin_0518.register()
    assert registry.registered_radix_cache_backends() == before
    [record] = [r for r in caplog.records if r.name == "sglang_cp_hicache.sglang_0518.plugin"]
    text = record.getMessage()
    assert record.levelname == "INFO", text
    assert "cp_hicache_0523 serves it" in text and "SGLang 0.5.23" in text, text
    assert ALLOW_ANY_ENV not in text and "0.5.21" not in text, text


def test_an_allow_list_without_this_release_s_plugin_is_a_warning(monkeypatch, caplog):
    """SGLANG_PLUGINS=cp_hicache (the 0.5.18 name) on 0.5.23 leaves the 0.5.23
    plugin out: the server would serve upstream's path without a word from
    SGLang above INFO. The 0.5.18 plugin, which does run, says so."""
    from sglang_cp_hicache.sglang_0518 import plugin as plugin_0518

    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    monkeypatch.setenv("SGLANG_PLUGINS", "cp_hicache")
    with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0518.plugin"):
        plugin_0518.register()
    [record] = [r for r in caplog.records if r.name == "sglang_cp_hicache.sglang_0518.plugin"]
    text = record.getMessage()
    assert record.levelname == "WARNING", text
    assert "SGLANG_PLUGINS='cp_hicache' leaves out 'cp_hicache_0523'" in text, text
    assert "without sglang-cp-hicache" in text, text


def test_sglang_reads_the_allow_list_as_the_library_does(monkeypatch):
    """Which of this package's plugins SGLang 0.5.23's loader loads, for
    allow-lists with a typo, spaces, both names, and none: exactly those
    ``releases.plugin_allowed`` says."""
    assert_loaded_as_allowed(monkeypatch, (
        "", "cp_hicache_0523", " cp_hicache_0523 , other", "cp-hicache_0523", "cp_hicache",
        "cp_hicache,cp_hicache_0523", ",", "  ",
    ))


def test_the_0523_plugin_says_nothing_wrong_when_it_registers(strategies, monkeypatch, caplog):
    monkeypatch.delenv(plugin.COPY_ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    strategy.uninstall_strategy()
    with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0523.plugin"):
        plugin.register()
    assert "library copy kernels registered" in caplog.text
    assert "WARNING" not in [r.levelname for r in caplog.records]
