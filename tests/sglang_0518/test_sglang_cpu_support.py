"""Real SGLang 0.5.18 HiCache on CPU through sglang_cp_hicache.testing.cpu_support.

Byte checks are bitwise (torch.equal on uint8 views); device buffers are
poisoned between eviction and load-back, so a transfer that writes nothing,
or writes the wrong rows, fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import pytest
import torch

import tests.helpers.sglang_fixtures as F
from sglang_cp_hicache.testing import cpu_support, env

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

# (layout, io backend) pairs ServerArgs 0.5.18 keeps as given; it rewrites
# page_first+direct and page_first_direct+kernel (test_server_args_normalises_layout_io).
SERVER_COMBOS = [
    ("layer_first", "kernel"),
    ("layer_first", "direct"),
    ("page_first", "kernel"),
    ("page_first_direct", "direct"),
]


@pytest.fixture(autouse=True)
def _cpu_support_installed():
    assert cpu_support.install_cpu_support()
    yield
    assert cpu_support.install_cpu_support()  # a test that uninstalled must leave it installed


def _key(tokens: Sequence[int]) -> RadixKey:
    return RadixKey(list(tokens))


def _load_back(cache, key: RadixKey, *, expect_host_hit: int):
    match = cache.match_prefix(MatchPrefixParams(key=key))
    assert match.host_hit_length == expect_host_hit
    loaded, _ = cache.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
    )
    assert len(loaded) == expect_host_hit
    assert cache.ready_to_load_host_cache() >= 0
    cache.loading_check()
    return match.device_indices, loaded


@pytest.mark.parametrize(("host_layout", "io_backend"), SERVER_COMBOS)
def test_hiradix_round_trip_restores_kv_and_indexer_bytes(host_layout, io_backend):
    with F.rank_stack(host_layout=host_layout, io_backend=io_backend, device_pages=8, host_pages=12) as stack:
        cache, pool, page = stack.cache, stack.kv_pool, stack.config.page_size
        assert (stack.server_args.hicache_mem_layout, stack.controller.io_backend) == (host_layout, io_backend)

        # A: three pages. B: A's first page, then one page of its own. Inserting B
        # splits A's backed-up node, so host_value is split too.
        a_key, a_pos = _key(range(1000, 1000 + 3 * page)), F.token_positions(0, 3 * page)
        a_locs = stack.allocator.alloc(3 * page)
        F.write_content(pool, a_locs, a_pos, seed=11)
        cache.insert(InsertParams(key=a_key, value=a_locs.clone()))
        cache.writing_check()

        b_key = _key(list(range(1000, 1000 + page)) + list(range(5000, 5000 + page)))
        b_tail_pos = F.token_positions(page, 2 * page)
        b_tail_locs = stack.allocator.alloc(page)
        F.write_content(pool, b_tail_locs, b_tail_pos, seed=22)
        cache.insert(InsertParams(key=b_key, value=torch.cat([a_locs[:page], b_tail_locs])))
        cache.writing_check()
        assert cache.ongoing_write_through == {}

        evicted = cache.evict(EvictParams(num_tokens=4 * page)).num_tokens_evicted
        assert evicted == 4 * page
        assert stack.allocator.available_size() == stack.config.device_pages * page
        F.poison_device(pool)

        a_device, a_loaded = _load_back(cache, a_key, expect_host_hit=3 * page)
        assert a_device.numel() == 0
        assert F.content_mismatches(pool, a_loaded, a_pos, seed=11) == []

        b_device, b_loaded = _load_back(cache, b_key, expect_host_hit=page)
        assert torch.equal(b_device, a_loaded[:page])  # the shared page is back on device
        assert F.content_mismatches(pool, b_loaded, b_tail_pos, seed=22) == []
        assert F.content_mismatches(pool, a_loaded, a_pos, seed=11) == []
        assert F.poisoned_elsewhere(pool, torch.cat([a_loaded, b_loaded])) == []

        assert cache.ongoing_load_back == {}
        assert cache.protected_size() == 0
        assert cache.evictable_size() == 4 * page

        # Nothing leaks: drop everything from device, then from host.
        assert cache.evict(EvictParams(num_tokens=4 * page)).num_tokens_evicted == 4 * page
        cache.evict_host(4 * page)
        assert stack.host_group.available_size() == stack.kv_host.page_num * page
        assert stack.allocator.available_size() == stack.config.device_pages * page


LAYOUT_IO = [(layout, io) for layout in ("layer_first", "page_first", "page_first_direct") for io in ("kernel", "direct")]


@pytest.mark.parametrize(
    ("kind", "host_layout", "io_backend"),
    [(kind, layout, io) for kind in ("kv", "indexer") for layout, io in LAYOUT_IO],
)
def test_host_pool_transfer_every_layout_and_io_backend(kind, host_layout, io_backend):
    """The patched host-pool methods, called directly with out-of-order pages."""
    with F.rank_stack(host_layout=host_layout, device_pages=8, host_pages=10) as stack:
        pool, page = stack.kv_pool, stack.config.page_size
        host = stack.kv_host if kind == "kv" else stack.indexer_host
        host_buffer = host.kv_buffer if kind == "kv" else host.index_k_with_scale_buffer

        def locs(pages):
            return (torch.tensor(pages).reshape(-1, 1) * page + torch.arange(page)).reshape(-1)

        src, dst, slots = locs([3, 1, 6]), locs([2, 7, 4]), locs([5, 0, 9])
        pos = F.token_positions(0, src.numel())
        F.write_content(pool, src, pos, seed=5)
        before = [b.clone() for b in (pool.kv_buffer if kind == "kv" else pool.index_k_with_scale_buffer)]

        host.backup_from_device_all_layer(pool, slots, src, io_backend)
        after = pool.kv_buffer if kind == "kv" else pool.index_k_with_scale_buffer
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))

        F.poison_device(pool)
        host_before = host_buffer.clone()
        for layer in range(pool.layer_num):
            host.load_to_device_per_layer(pool, slots, dst, layer, io_backend)
        assert torch.equal(host_buffer.view(torch.uint8), host_before.view(torch.uint8))

        prefix = "kv[" if kind == "kv" else "index"
        assert [m for m in F.content_mismatches(pool, dst, pos, seed=5) if m.startswith(prefix)] == []
        assert [m for m in F.poisoned_elsewhere(pool, dst) if m.startswith(prefix)] == []


def test_patched_transfers_reject_what_they_do_not_model():
    with F.rank_stack() as stack:
        pool, locs = stack.kv_pool, torch.arange(64, 128)
        with pytest.raises(ValueError, match="Unsupported IO backend"):
            stack.kv_host.backup_from_device_all_layer(pool, locs, locs, "kernel_ascend")
        with pytest.raises(NotImplementedError, match="MTP"):
            stack.indexer_host.load_to_device_per_layer(pool, locs, locs, 0, "kernel", is_draft=True)
        with pytest.raises(ValueError, match="page-aligned"):
            stack.indexer_host.backup_from_device_all_layer(pool, locs[:10], locs[:10], "kernel")


def test_install_is_idempotent_and_uninstall_restores_originals():
    from sglang.srt.mem_cache import memory_pool_host
    from sglang.srt.mem_cache.pool_host import base, common, mla

    targets = [
        (common, "_cuda_host_register"),
        (common, "_cuda_host_unregister"),
        (base, "_cuda_host_unregister"),
        (mla.MLATokenToKVPoolHost, "backup_from_device_all_layer"),
        (mla.MLATokenToKVPoolHost, "load_to_device_per_layer"),
        (mla.MLATokenToKVPoolHost, "get_dummy_flat_data_page"),
        (memory_pool_host.DSAIndexerPoolHost, "backup_from_device_all_layer"),
        (memory_pool_host.DSAIndexerPoolHost, "load_to_device_per_layer"),
        (memory_pool_host.DSAIndexerPoolHost, "get_dummy_flat_data_page"),
    ]
    patched = [vars(owner)[name] for owner, name in targets]
    assert all(getattr(fn, "__sglang_cp_hicache_cpu_patch__", False) for fn in patched)
    assert cpu_support.install_cpu_support()  # second install changes nothing
    assert [vars(owner)[name] for owner, name in targets] == patched

    cpu_support.uninstall_cpu_support()
    try:
        assert not cpu_support.cpu_support_installed()
        restored = [vars(owner)[name] for owner, name in targets]
        assert not any(getattr(fn, "__sglang_cp_hicache_cpu_patch__", False) for fn in restored)
        assert restored[0].__module__ == common.__name__
    finally:
        assert cpu_support.install_cpu_support()


def test_install_acts_only_without_cuda_unless_forced(monkeypatch):
    cpu_support.uninstall_cpu_support()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_support.install_cpu_support() is False
    assert not cpu_support.cpu_support_installed()
    assert cpu_support.install_cpu_support(force=True) is True
    assert cpu_support.cpu_support_installed()
    monkeypatch.undo()


def test_unpinned_dummy_page_matches_a_host_page():
    with F.rank_stack(host_layout="page_first") as stack:
        for host in (stack.kv_host, stack.indexer_host):
            assert host.pin_memory  # SGLang's default; nothing was pinned (no CUDA)
            dummy = host.get_dummy_flat_data_page()
            page = host.get_data_page(0, flat=True)
            assert (dummy.dtype, dummy.shape, dummy.is_pinned()) == (page.dtype, page.shape, False)
            assert not dummy.any()


def test_dsa_device_pool_requires_page_size_64():
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    with pytest.raises(AssertionError):
        DSATokenToKVPool(
            size=64, page_size=16, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64,
            layer_num=1, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576,
        )


@pytest.mark.parametrize(
    ("asked", "got"),
    [
        (("page_first", "direct"), ("page_first_direct", "direct")),
        (("page_first_direct", "kernel"), ("page_first_direct", "direct")),
        (("layer_first", "direct"), ("layer_first", "direct")),
        (("page_first", "kernel"), ("page_first", "kernel")),
    ],
)
def test_server_args_normalises_layout_io(asked, got):
    server_args = env.make_cpu_server_args(hicache_mem_layout=asked[0], hicache_io_backend=asked[1])
    assert (server_args.hicache_mem_layout, server_args.hicache_io_backend) == got


def test_server_args_leave_the_environment_alone():
    before = dict(os.environ)
    env.make_cpu_server_args()
    assert dict(os.environ) == before


def test_host_pages_and_build_time():
    with F.rank_stack(device_pages=4, host_pages=7, num_layers=3) as stack:
        assert stack.kv_host.page_num == 7
        assert stack.kv_host.kv_buffer.shape == (3, 7 * 64, 1, 576)
        assert stack.build_seconds < 2.0, stack.build_seconds


def test_local_gloo_group_is_a_single_rank():
    group = env.make_local_gloo_group()
    assert torch.distributed.get_world_size(group=group) == 1
    value = torch.tensor([3], dtype=torch.int32)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=group)
    assert value.item() == 3


def test_ensure_sglang_importable_keeps_a_working_torchvision(tmp_path):
    # A torchvision that imports is kept: here an on-disk package (in tmp_path,
    # on PYTHONPATH for the child only) exporting the names SGLang imports.
    from sglang_cp_hicache.testing.torchvision_standin import _STANDIN_MODULES

    for name in _STANDIN_MODULES:
        pkg = tmp_path.joinpath(*name.split("."))
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(
            "from sglang_cp_hicache.testing.torchvision_standin import _STANDIN_MODULES as _M\n"
            f"globals().update(_M[{name!r}])\n"
            + ("__version__ = 'on-disk'\n" if name == "torchvision" else "")
        )
    code = (
        "import sys, torchvision\n"
        "from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable, "
        "torchvision_standin_installed\n"
        "print(ensure_sglang_importable(), torchvision_standin_installed(), "
        "sys.modules['torchvision'] is torchvision, torchvision.__version__)\n"
    )
    child_env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env, cwd="/", timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "True", "on-disk"]


def test_ensure_sglang_importable_stands_in_when_torchvision_is_missing():
    code = (
        "import sys\n"
        "from sglang_cp_hicache.testing.cpu_support import ensure_sglang_importable\n"
        "assert 'torchvision' not in sys.modules\n"
        "print(ensure_sglang_importable())\n"
        "import sglang.srt.server_args, sglang.srt.mem_cache.hiradix_cache\n"
        "import sglang.srt.managers.schedule_policy\n"
        "import torchvision, torchvision.transforms as T\n"
        "print(torchvision.__version__, T.InterpolationMode.NEAREST_EXACT.value)\n"
        "try:\n"
        "    torchvision.io.decode_jpeg(None)\n"
        "except RuntimeError as e:\n"
        "    print('raises', 'stand-in' in str(e))\n"
    )
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env, cwd="/", timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "True",
        cpu_support.TORCHVISION_STANDIN_VERSION,
        "nearest-exact",
        "raises",
        "True",
    ]


def test_tiny_model_config_ships_with_the_package_and_matches():
    import json as _json

    path = os.path.join(env.tiny_model_dir(), "config.json")
    with open(path) as f:
        assert _json.load(f) == env.TINY_MODEL_CONFIG
    # no temporary directory: nothing for a killed process to leave behind
    assert os.path.dirname(os.path.abspath(env.__file__)) in os.path.abspath(path)
