"""The CPU harness for 0.5.23: the pure-torch stock copy ops and the shims."""

from __future__ import annotations

import importlib

import pytest
import torch

from sglang_cp_hicache.testing import cpu_0523

ROW = 24  # bytes per row


def _buf(rows: int, fill: int) -> torch.Tensor:
    return torch.full((rows, 1, ROW), fill, dtype=torch.uint8)


def _numbered(rows: int) -> torch.Tensor:
    return (torch.arange(rows * ROW) % 251).to(torch.uint8).view(rows, 1, ROW)


def test_per_layer_copy_moves_exactly_the_indexed_rows():
    src, dst = _numbered(10), _buf(8, 0xEE)
    cpu_0523.transfer_kv_per_layer_mla(src, dst, torch.tensor([7, 2, 5]), torch.tensor([0, 6, 3]), ROW)
    assert torch.equal(dst[[0, 6, 3]], src[[7, 2, 5]])
    untouched = [i for i in range(8) if i not in (0, 6, 3)]
    assert bool((dst[untouched] == 0xEE).all())


def test_page_first_layer_is_read_at_its_offset():
    layers = 3
    host = _numbered(6 * layers).view(6, layers, 1, ROW)  # page_first (rows, layers, 1, dim)
    dst = _buf(4, 0)
    cpu_0523.transfer_kv_per_layer_mla_pf_lf(
        host, dst, torch.tensor([5, 1]), torch.tensor([2, 0]), layer_id=1, item_size=ROW, src_layout_dim=layers * ROW
    )
    assert torch.equal(dst[2, 0], host[5, 1, 0]) and torch.equal(dst[0, 0], host[1, 1, 0])


def test_all_layer_ops_resolve_registered_addresses_only():
    src = [_numbered(6), _numbered(6).flip(0).contiguous()]
    dst = [_buf(6, 0), _buf(6, 0)]
    src_table = torch.tensor([t.data_ptr() for t in src], dtype=torch.uint64)
    dst_table = torch.tensor([t.data_ptr() for t in dst], dtype=torch.uint64)
    with pytest.raises(RuntimeError, match="belongs to no registered buffer"):
        cpu_0523.transfer_kv_all_layer_mla(src_table, dst_table, torch.tensor([1]), torch.tensor([2]), ROW, 2)
    cpu_0523._register(src_table, src)
    cpu_0523._register(dst_table, dst)
    cpu_0523.transfer_kv_all_layer_mla(src_table, dst_table, torch.tensor([1, 4]), torch.tensor([2, 0]), ROW, 2)
    for s, d in zip(src, dst):
        assert torch.equal(d[[2, 0]], s[[1, 4]])
    host = torch.zeros((5, 2, 1, ROW), dtype=torch.uint8)
    cpu_0523.transfer_kv_all_layer_mla_lf_pf(src_table, host, torch.tensor([3]), torch.tensor([4]), ROW, 2 * ROW, 2)
    assert torch.equal(host[4, 0, 0], src[0][3, 0]) and torch.equal(host[4, 1, 0], src[1][3, 0])
    assert int(host[:4].count_nonzero()) == 0


def test_register_refuses_a_table_that_does_not_match_its_tensors():
    t = _buf(2, 0)
    with pytest.raises(ValueError, match="is not the tensor's"):
        cpu_0523._register(torch.tensor([t.data_ptr() + 8], dtype=torch.uint64), [t])


def test_direct_io_is_refused():
    with pytest.raises(NotImplementedError, match="'direct' io is not emulated"):
        cpu_0523.TRANSFER_OPS["transfer_kv_direct"]([], [], None, None, 64)


def test_install_and_uninstall_restore_every_attribute():
    mla = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    pool = importlib.import_module("sglang.srt.mem_cache.page_interleave_pool")
    was_installed = cpu_0523.cpu_support_installed()
    cpu_0523.uninstall_cpu_support()
    register, nccl = common._cuda_host_register, pool.PyNcclCommunicator
    assert not hasattr(mla, "transfer_kv_all_layer_mla")  # unbound on CPU: the gap being filled
    assert cpu_0523.install_cpu_support()
    assert mla.transfer_kv_all_layer_mla is cpu_0523.transfer_kv_all_layer_mla
    assert pool.PyNcclCommunicator is cpu_0523.InertPyNcclCommunicator
    assert hasattr(torch.cpu.Stream(), "synchronize")
    cpu_0523.uninstall_cpu_support()
    assert not hasattr(mla, "transfer_kv_all_layer_mla")
    assert common._cuda_host_register is register and pool.PyNcclCommunicator is nccl
    assert not hasattr(torch.cpu.Stream, "synchronize")
    if was_installed:
        cpu_0523.install_cpu_support()


def test_inert_communicator_refuses_any_use():
    comm = cpu_0523.InertPyNcclCommunicator(group=None, device="cpu")
    with pytest.raises(RuntimeError, match="PyNcclCommunicator.all_gather is not available on CPU"):
        comm.all_gather
