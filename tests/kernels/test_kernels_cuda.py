"""On a GPU only (skipped otherwise): bitwise round trips through the four
compiled kernels on cudaHostRegister'ed and pinned host buffers, and the
copies under torch.cuda.set_sync_debug_mode("error") -- the checks of
bench/gpu_check.py, run by ``pytest -k cuda``."""

from __future__ import annotations


import pytest
import torch

from sglang_cp_hicache.placement import CpPlacement

from tests.helpers.bench_scripts import bench_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_check():
    with bench_module("gpu_check") as module:
        yield module


@pytest.mark.parametrize("alloc", ["registered", "pinned"])
@pytest.mark.parametrize("kind", ["kv_fp8", "kv_bf16", "indexer"])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first", "page_first_direct"])
def test_cuda_round_trip_is_bitwise(gpu_check, alloc, kind, host_layout):
    g = gpu_check.GPU_GEOMETRY
    host = gpu_check.HostBuffer(gpu_check.host_shape(kind, host_layout, g), gpu_check.KINDS[kind][1], alloc)
    try:
        assert host.tensor.is_pinned()
        for n, r in ((1, 0), (2, 1), (8, 0), (8, 7)):
            err = gpu_check.roundtrip(kind, host_layout, CpPlacement(g.page_size, n, r), host, g,
                                      torch.device("cuda"), seed=n * 8 + r)
            assert err is None, (n, r, err)
    finally:
        host.close()


def test_cuda_copies_never_sync(gpu_check):
    results = gpu_check.run_sync_free(torch.device("cuda"), gpu_check.GPU_GEOMETRY, ["registered", "pinned"])
    assert results and all(v is True for v in results.values()), {k: v for k, v in results.items() if v is not True}
