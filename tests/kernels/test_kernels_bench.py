"""bench/bench_transfer.py on CPU: its baseline providers move the bytes they
claim to (so GPU numbers compare like with like), and a tiny CPU run writes
the long-format CSV and one PNG per direction."""

from __future__ import annotations

import csv

import pytest
import torch

from sglang_cp_hicache.placement import CpPlacement

from tests.helpers.bench_scripts import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_transfer") as module:
        yield module


@pytest.mark.parametrize("kind", ["indexer", "kv_fp8", "kv_bf16"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_baselines_move_the_same_pages_as_the_reference(bench, kind, direction):
    cpu = torch.device("cpu")
    placement = CpPlacement(bench.PAGE_SIZE, 1, 0)
    dl, hl, phys, hpages = bench.make_batch(5, 8, placement, cpu, seed=3)
    assert phys.tolist() == (dl[:: bench.PAGE_SIZE] // bench.PAGE_SIZE).tolist()

    ref = bench.make_pools(kind, "layer_first", 2, 8, cpu)
    if direction == "h2d":
        ref.host.view(torch.uint8).random_(0, 256)
    direct = bench.make_pools(kind, "layer_first", 2, 8, cpu)
    direct.devs = [d.clone() for d in ref.devs]
    direct.dev_pages = [d.view(torch.uint8).view(-1, ref.page_bytes) for d in direct.devs]
    direct.host.copy_(ref.host)
    bench.reference_call(ref, direction, dl, hl, placement)()
    bench.direct_call(direct, direction, phys, hpages)()
    assert torch.equal(ref.host.view(torch.uint8), direct.host.view(torch.uint8))
    for a, b in zip(ref.devs, direct.devs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    staged = bench.make_pools(kind, "layer_first", 2, 8, cpu)
    staging = torch.empty(8, staged.page_bytes, dtype=torch.uint8)
    pinned = torch.randint(0, 256, (2, 8, staged.page_bytes), dtype=torch.uint8)
    bench.torch_staged_call(staged, direction, phys, hpages, staging, pinned)()
    if direction == "d2h":
        for layer in range(2):
            assert torch.equal(pinned[layer, :5], staged.dev_pages[layer][phys])
    else:
        assert torch.equal(staged.dev_pages[0][phys], pinned[0, :5])


@pytest.mark.parametrize("cp_size", [1, 2, 8])
@pytest.mark.parametrize("num_pages", [1, 7, 8, 17, 64])
def test_batches_have_the_real_owner_mix(bench, cp_size, num_pages):
    """Groups of cp_size consecutive logical pages, one per owner: rank 0 owns
    ceil(num_pages / cp_size) of them, every rank its round-robin share."""
    for rank in range(cp_size):
        placement = CpPlacement(bench.PAGE_SIZE, cp_size, rank)
        dl, hl, phys, hpages = bench.make_batch(num_pages, 64, placement, torch.device("cpu"), seed=num_pages)
        logical = dl[:: bench.PAGE_SIZE] // bench.PAGE_SIZE
        assert logical.numel() == num_pages and logical.unique().numel() == num_pages
        assert (logical % cp_size).tolist() == [i % cp_size for i in range(num_pages)]
        owned = logical[logical % cp_size == rank]
        assert owned.numel() == len(range(rank, num_pages, cp_size)) == phys.numel() == hpages.numel()
        assert torch.equal(phys, owned // cp_size) and all(0 <= p < 64 for p in phys.tolist())
        assert hl.numel() == owned.numel() * bench.PAGE_SIZE and hpages.unique().numel() == hpages.numel()


def test_cpu_run_writes_csv_and_plots(bench, tmp_path):
    rc = bench.main(["--cpu", "--quick", "--pages", "1,4,16", "--layers", "2", "--ceiling-mib", "8",
                     "--kinds", "indexer,kv_fp8", "--cp-sizes", "1,8", "--out", str(tmp_path),
                     "--git-sha", "abc123"])
    assert rc == 0
    with open(tmp_path / "transfer_cpu_quick.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench.CSV_FIELDS
    assert len(rows) == 2 * 2 * 3 * 2  # kinds x cp sizes x pages x directions
    assert {r["provider"] for r in rows} == {"reference"}
    assert {r["git_sha"] for r in rows} == {"abc123"}
    assert {r["cp_size"] for r in rows} == {"1", "8"}
    for r in rows:
        assert float(r["p20_ms"]) <= float(r["p50_ms"]) <= float(r["p80_ms"])
        assert float(r["gbps"]) > 0 and float(r["ceiling_gbps"]) > 0
        layers = 2 if r["direction"] == "d2h" else 1
        cp, pages = int(r["cp_size"]), int(r["num_pages"])
        assert int(r["owned_pages"]) == -(-pages // cp)  # rank 0's round-robin share
        assert int(r["bytes"]) == int(r["owned_pages"]) * int(r["page_bytes"]) * layers
    for direction in ("d2h", "h2d"):
        png = tmp_path / f"transfer_cpu_quick_{direction}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
