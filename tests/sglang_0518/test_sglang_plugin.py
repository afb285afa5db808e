"""Activation: the sglang.srt.plugins entry point and the cp-hicache backend."""

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from sglang_cp_hicache.sglang_0518 import plugin
from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache
from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack

from tests.helpers.plugin_loading import assert_loaded_as_allowed


def test_entry_point_is_declared_for_sglang_plugin_loader():
    eps = entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.value == "sglang_cp_hicache.sglang_0518.plugin:register"]
    assert len(ours) == 1 and ours[0].load() is plugin.register


def test_register_is_idempotent_and_selectable():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, registered_radix_cache_backends

    plugin.register()
    plugin.register()
    assert registered_radix_cache_backends().count("cp-hicache") == 1
    assert get_radix_cache_factory("cp-hicache") is plugin.cp_hicache_factory


class Worker:
    def __init__(self):
        self.counters = []

    def register_hicache_layer_transfer_counter(self, counter):
        self.counters.append(counter)


def ctx_for(stack, hierarchical=True):
    return SimpleNamespace(params=stack_params(stack), server_args=stack.server_args,
                           enable_hierarchical_cache=hierarchical, tp_worker=Worker())


def stack_params(stack):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=stack.allocator,
                           page_size=stack.config.page_size, tp_cache_group=stack.cache.tp_group,
                           attn_cp_cache_group=stack.cache.tp_group)


def test_factory_builds_cp_cache_for_cp_allocator(caplog):
    stack = build_cp_rank_stack(CpStackConfig(cp_size=2), 1)
    try:
        ctx = ctx_for(stack)
        with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0518.plugin"):
            cache = plugin.cp_hicache_factory(ctx)
        assert isinstance(cache, CpHiRadixCache) and cache.cp_placement.cp_rank == 1
        # one start-up line per rank says which copy path runs
        [line] = [r.getMessage() for r in caplog.records if "Copy path:" in r.getMessage()]
        assert "cp_rank 1 of 2" in line and f"Copy path: library (this library's kernels, backend " \
            f"{cache.cp_warmup.backend})" in line
        assert [r.levelname for r in caplog.records if r.name.endswith("plugin")] == ["INFO"]
        assert ctx.tp_worker.counters == [cache.cache_controller.layer_done_counter]
        with pytest.raises(ValueError, match="enable-hierarchical-cache"):
            plugin.cp_hicache_factory(ctx_for(stack, hierarchical=False))
    finally:
        stack.close()


def test_factory_without_cp_allocator_warns_what_is_missing_and_defers_to_sglang(caplog):
    """Stock SGLang 0.5.18 builds no CP shared KV pool: the backend cannot run
    CP there, and says so at WARNING on every rank -- what it needs, what it
    found, and which path runs instead -- before handing over to SGLang."""
    stack = build_cp_rank_stack(CpStackConfig(cp_size=1, cp_mode=False), 0)
    try:
        seen = []
        import sglang.srt.mem_cache.registry as registry

        orig = registry.default_radix_cache_factory
        registry.default_radix_cache_factory = lambda ctx: seen.append(ctx) or "default"
        try:
            ctx = ctx_for(stack)
            assert not isinstance(stack.allocator, plugin_allocator_class())
            with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0518.plugin"):
                assert plugin.cp_hicache_factory(ctx) == "default" and seen == [ctx]
        finally:
            registry.default_radix_cache_factory = orig
    finally:
        stack.close()
    [record] = [r for r in caplog.records if r.name == "sglang_cp_hicache.sglang_0518.plugin"]
    text = record.getMessage()
    assert record.levelname == "WARNING", text
    assert plugin.CP_ALLOCATOR in text and "CpSharedPagedTokenToKVPoolAllocator" in text
    found = type(stack.allocator)
    assert f"this server's is {found.__module__}.{found.__qualname__}" in text
    assert "Stock SGLang 0.5.18 never builds one" in text
    assert "Copy path: SGLang's default cache, no CP HiCache on this rank" in text


def plugin_allocator_class():
    from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator

    assert plugin.CP_ALLOCATOR == (
        f"{CpSharedPagedTokenToKVPoolAllocator.__module__}.{CpSharedPagedTokenToKVPoolAllocator.__qualname__}"
    )
    return CpSharedPagedTokenToKVPoolAllocator


def test_other_sglang_releases_are_refused(monkeypatch):
    from sglang_cp_hicache.sglang_0518 import check_sglang_version

    check_sglang_version("0.5.18")
    with pytest.raises(RuntimeError, match="0.5.18.*0.5.21"):
        check_sglang_version("0.5.21")
    monkeypatch.setenv("SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG", "1")
    check_sglang_version("0.5.21")


def test_factory_warms_the_copy_kernels_up_for_this_server(monkeypatch, caplog):
    """Server start compiles (CUDA) or loads (interpreter) exactly the kernels
    this cache's pools need, once per cache, and says so in one log line."""
    from sglang_cp_hicache.kernels import transfer

    calls = []
    real = transfer.warmup

    def recording_warmup(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(transfer, "warmup", recording_warmup)
    config = CpStackConfig(cp_size=2, num_layers=3, host_layout="page_first")
    stack = build_cp_rank_stack(config, 1)
    try:
        assert len(calls) == 1  # build_cp_rank_stack's cache
        calls.clear()
        with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0518.hiradix"):
            cache = plugin.cp_hicache_factory(ctx_for(stack))
        expected = dict(
            page_size=64, host_layout="page_first", num_layers=3,
            kv_dim=config.kv_lora_rank + config.qk_rope_head_dim, kv_dtype=config.dtype,
            indexer_page_bytes=64 * (config.index_head_dim + 4), device=stack.kv_pool.kv_buffer[0].device,
        )
        assert calls == [expected]
        reported = cache.cp_warmup.config  # JSON-ready: names for device and dtype
        assert {k: reported[k] for k in expected} == {
            **expected, "device": "cpu", "kv_dtype": str(config.dtype).removeprefix("torch.")
        }
        lines = [r.getMessage() for r in caplog.records if "copy kernels ready" in r.getMessage()]
        assert len(lines) == 1 and "cp_rank 1/2" in lines[0] and "TRITON_CACHE_DIR" in lines[0]
    finally:
        stack.close()


def _register_as(version, monkeypatch, caplog, *, hiradix=True):
    """The plugin's registrations and its one log record, on SGLang ``version``."""
    import importlib.util

    import sglang
    from sglang.srt.mem_cache import registry

    seen = []

    def register_radix_cache_backend(name, factory):  # upstream's parameter names: the hook check passes
        seen.append((name, factory))

    monkeypatch.setattr(registry, "register_radix_cache_backend", register_radix_cache_backend)
    monkeypatch.setattr(registry, "get_radix_cache_factory", lambda name: None)
    monkeypatch.setattr(sglang, "__version__", version)
    if not hiradix:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name.endswith(".hiradix_cache") else real(name, *a))
    caplog.clear()
    with caplog.at_level("INFO", logger="sglang_cp_hicache.sglang_0518.plugin"):
        plugin.register()
    records = [r for r in caplog.records if r.name == "sglang_cp_hicache.sglang_0518.plugin"]
    return seen, records


def test_register_does_nothing_under_another_sglang_and_says_what_is_right_there(monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG", raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    # 0.5.23: this package's other plugin serves it; no advice that is wrong there
    seen, [record] = _register_as("0.5.23", monkeypatch, caplog)
    text = record.getMessage()
    assert seen == [] and record.levelname == "INFO"
    assert "the plugin cp_hicache_0523 serves it" in text and "ALLOW_ANY" not in text, text
    # a release that still ships HiRadixCache: the way to try anyway
    seen, [record] = _register_as("0.5.20", monkeypatch, caplog)
    text = record.getMessage()
    assert seen == [] and record.levelname == "WARNING"
    assert "SGLang 0.5.20 has no adapter" in text and "SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG=1" in text, text
    # one without it: no such advice (the adapter cannot work there)
    seen, [record] = _register_as("0.5.22", monkeypatch, caplog, hiradix=False)
    text = record.getMessage()
    assert seen == [] and record.levelname == "WARNING"
    assert "no HiRadixCache (0.5.21 removed it)" in text and "ALLOW_ANY" not in text, text
    monkeypatch.undo()
    monkeypatch.delenv("SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG", raising=False)
    seen, records = _register_as("0.5.18", monkeypatch, caplog)
    assert seen == [("cp-hicache", plugin.cp_hicache_factory)]
    assert [r for r in records if r.levelno >= 30] == []


def test_sglang_reads_the_allow_list_as_the_library_does(monkeypatch):
    """Which of this package's plugins SGLang 0.5.18's loader loads, for
    allow-lists with a typo, spaces, both names, and none: exactly those
    ``releases.plugin_allowed`` says. On 0.5.18 a list without cp_hicache
    leaves --radix-cache-backend cp-hicache unregistered, which SGLang refuses."""
    assert_loaded_as_allowed(monkeypatch, (
        "", "cp_hicache", " cp_hicache , other", "cp-hicache", "cp_hicache_0523",
        "cp_hicache,cp_hicache_0523", ",", "  ",
    ))


def test_the_0523_plugin_on_0518_points_to_this_release_s_plugin(monkeypatch, caplog):
    """SGLang 0.5.18 loads the 0.5.23 entry point too: it registers nothing and
    names the plugin that serves 0.5.18 -- a WARNING when SGLANG_PLUGINS
    leaves that one out (then --radix-cache-backend cp-hicache is unregistered)."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    from sglang_cp_hicache.sglang_0523 import plugin as plugin_0523

    logger = "sglang_cp_hicache.sglang_0523.plugin"
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    before = list(assembler._STRATEGIES)
    with caplog.at_level("INFO", logger=logger):
        plugin_0523.register()
    # 0.5.18 has the strategy seam but no sharded pool: a strategy of ours there
    # would be asked to match every HiCache stack SGLang builds
    assert assembler._STRATEGIES == before
    [record] = [r for r in caplog.records if r.name == logger]
    text = record.getMessage()
    assert record.levelname == "INFO"
    assert "the plugin cp_hicache serves it" in text and "--radix-cache-backend cp-hicache" in text, text
    assert "no KV sharding" in text and "ALLOW_ANY" not in text, text
    caplog.clear()
    monkeypatch.setenv("SGLANG_PLUGINS", "cp_hicache_0523")
    with caplog.at_level("INFO", logger=logger):
        plugin_0523.register()
    [record] = [r for r in caplog.records if r.name == logger]
    assert record.levelname == "WARNING" and "leaves out 'cp_hicache'" in record.getMessage()
