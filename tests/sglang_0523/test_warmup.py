"""The strategy compiles (CUDA) or loads (interpreter) the four copy kernels
for exactly the stack's pools when it builds the stack, and logs one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.sglang_0523.warmup import warmup_arguments

OPS = ["kv_d2h", "kv_h2d", "indexer_d2h", "indexer_h2d"]


def test_the_library_build_warms_up_for_its_pools_and_logs_one_line(two_ranks):
    for rank, result in enumerate(two_ranks):
        warmups = result["differential"]["warmups"]
        assert sorted(warmups) == ["layer_first/library", "layer_first/upstream", "page_first/library",
                                   "page_first/upstream"]
        for key, seen in warmups.items():
            layout, path = key.split("/")
            if path == "upstream":  # upstream's stack: nothing of ours runs
                assert seen["calls"] == [] and seen["report"] is None and seen["log"] == [], key
                continue
            pools = seen["pools"]
            assert pools["host_layout"] == layout and pools["page_size"] == 64 and pools["num_layers"] == 2
            assert pools["kv_dim"] == 576 and pools["indexer_page_bytes"] == 64 * 132, pools
            (call,) = seen["calls"]
            assert call == pools, key  # page size, layout, layers, kv_dim, dtype, indexer page bytes, device
            report = seen["report"]
            assert report["backend"] == "triton-interpret" and report["ops"] == OPS, key
            expected = {k: v for k, v in pools.items()}
            expected["kv_dtype"] = pools["kv_dtype"].removeprefix("torch.")
            assert {k: report["config"][k] for k in expected} == expected, key
            ready = [line for line in seen["log"] if "copy kernels ready" in line]
            assert len(ready) == 1, seen["log"]
            assert ready[0].startswith(
                f"sglang-cp-hicache: copy kernels ready on cp_rank {rank} of 2: backend=triton-interpret, "
                "4 kernel(s) kv_d2h,kv_h2d,indexer_d2h,indexer_h2d in "
            ) and "(cache dir: None;" in ready[0], ready[0]


def _group(anchor, index_layer):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return SimpleNamespace(
        layout="page_first",
        anchor_entry=SimpleNamespace(host_pool=anchor),
        entry_map={PoolName.INDEXER: SimpleNamespace(host_pool=SimpleNamespace(
            packed_device_index_buffers=[index_layer]))},
    )


def test_warmup_arguments_refuse_an_anchor_that_is_not_sharded_mla():
    with pytest.raises(TypeError, match="the anchor host pool is SimpleNamespace, not a sharded MLA host pool"):
        warmup_arguments(_group(SimpleNamespace(page_size=64), torch.zeros(1, 8448, dtype=torch.uint8)))
