"""Offline compile for Hopper (sm_90) without a GPU, and what the PTX says.

The compile runs in a fresh interpreter with a fresh TRITON_CACHE_DIR, so it
really compiles (ptxas included) and cannot be affected by TRITON_INTERPRET or
by kernels other tests already ran in this process.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

# The compile job runs in a subprocess with TRITON_INTERPRET set or removed
# by _run_job: the interpreted re-run would repeat the tests on it unchanged.
SAME = pytest.mark.same_under_interpret

JOB = pathlib.Path(__file__).resolve().parents[1] / "helpers" / "kernels_aot_job.py"
ROOT = JOB.parents[1]

# 16-byte global accesses: 4 x 32-bit or 2 x 64-bit lanes, any cache qualifiers
VEC16_LD = re.compile(r"\bld\.global(?:\.[\w:]+)*\.(?:v4\.b32|v2\.b64)\b")
VEC16_ST = re.compile(r"\bst\.global(?:\.[\w:]+)*\.(?:v4\.b32|v2\.b64)\b")
ANY_ST = re.compile(r"\bst\.global(?:\.[\w:]+)*\b")


def _run_job(tmp: pathlib.Path, **env_over) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp / "triton-cache"), **env_over)
    out = tmp / "ptx"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(JOB), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "index.json").read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return _run_job(tmp_path_factory.mktemp("aot"))


@SAME
def test_every_specialisation_compiles_for_sm90(compiled):
    # 8 configurations: 6 with two buffers (4 ops), 2 with one (2 ops) -> see the job's CONFIGS
    assert len(compiled) == 3 * 4 + 3 * 2 + 4 + 2
    for name, info in compiled.items():
        ptx = pathlib.Path(info["ptx"]).read_text()
        assert ".target sm_90" in ptx, name
        assert ".entry _copy_pages_kernel" in ptx, name
        assert info["cubin_bytes"] > 0, name


@SAME
def test_copy_loops_use_16_byte_vector_loads_and_stores(compiled):
    checked = 0
    for name, info in compiled.items():
        if not info["expect_vectors"]:
            continue
        ptx = pathlib.Path(info["ptx"]).read_text()
        stores = ANY_ST.findall(ptx)
        vec_loads = VEC16_LD.findall(ptx)
        vec_stores = VEC16_ST.findall(ptx)
        # the kernel stores only page data: every store must be 16 bytes wide
        assert stores and len(vec_stores) == len(stores), (name, sorted(set(stores)))
        # and every stored vector was loaded as a vector (indices are the only scalar loads)
        assert len(vec_loads) == len(vec_stores), (name, len(vec_loads), len(vec_stores))
        # software pipelining: the tile load sits at two sites (before the
        # loop and inside it, ahead of the store of the previous tile), each
        # a tile's worth of vectors per thread
        per_thread = info["tile_bytes"] // (32 * info["num_warps"] * 16)
        assert len(vec_loads) == 2 * per_thread, (name, len(vec_loads), per_thread)
        checked += 1
    assert checked == 3 * 4 + 3 * 2 + 4


@SAME
def test_misaligned_pages_compile_to_narrow_accesses(compiled):
    """132-byte pages (indexer, page_size 1) cannot be 16-byte aligned: the
    launcher picks 4-byte words, and the PTX says so (no silent misaligned vectors)."""
    for op in ("indexer_d2h", "indexer_h2d"):
        ptx = pathlib.Path(compiled[f"p1_page_first_indexer__{op}"]["ptx"]).read_text()
        assert not VEC16_ST.findall(ptx) and not VEC16_LD.findall(ptx)
        assert set(ANY_ST.findall(ptx)) == {"st.global.b32"}


@SAME
@pytest.mark.slow(8)
def test_compiles_even_when_triton_interpret_was_set_at_import(tmp_path):
    """With TRITON_INTERPRET=1 at start-up the module's own kernel is the
    interpreted one; compile_offline builds the compiled twin instead."""
    index = _run_job(tmp_path, TRITON_INTERPRET="1", AOT_JOB_SMALL="1")
    assert len(index) == 4
    for info in index.values():
        ptx = pathlib.Path(info["ptx"]).read_text()
        assert len(VEC16_ST.findall(ptx)) == len(ANY_ST.findall(ptx)) > 0


def test_no_recompile_across_ranks_layers_batch_sizes_and_slices():
    """The JIT cache key (Triton's own per-argument specialisation plus the
    constexprs) is the same whatever the rank, CP size, layer, page count or
    index-tensor offset: only the pool configuration picks a specialisation."""
    import dataclasses

    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from sglang_cp_hicache.kernels import _launch_spec, _twin, compile, _triton_launch
    from sglang_cp_hicache.placement import CpPlacement

    kernel = _twin.kernel_for(False)
    stand_ins = compile._stand_ins(
        page_size=16, host_layout="page_first", num_layers=3, kv_dim=656, kv_dtype=torch.uint8,
        indexer_page_bytes=16 * 132, device=torch.device("cpu"), pin_memory=False,
    )

    def key(plan, locs, host_locs, placement):
        part = _launch_spec.pool_part(plan, placement.page_size, _triton_launch.DEFAULT_BLOCK_BYTES)
        spec = _launch_spec.specialise(part, locs, host_locs, placement, 4)
        per_arg = [
            native_specialize_impl(BaseBackend, arg, p.is_constexpr, not p.do_not_specialize,
                                   not p.do_not_specialize_on_alignment)
            for p, arg in zip(kernel.params, spec.args)
        ]
        return per_arg, sorted(spec.meta.items())

    big = torch.arange(64 * 16 + 1, dtype=torch.int64)
    for s in stand_ins:
        op, plan = s.op, s.plan
        keys = set()
        for cp_size, cp_rank, layer, num_pages, offset in [
            (1, 0, 0, 1, 0), (2, 1, 1, 16, 1), (4, 3, 2, 17, 0), (3, 2, 0, 64, 1), (8, 5, 1, 2, 0),
        ]:
            locs = big[offset : offset + 16 * num_pages]
            p = dataclasses.replace(plan, layer_base=layer if op.endswith("h2d") else 0)
            host_locs = big[1 - offset : 1 - offset + 16 * num_pages]
            keys.add(repr(key(p, locs, host_locs, CpPlacement(16, cp_size, cp_rank))))
        assert len(keys) == 1, (op, keys)
    # ...while the pool configuration does pick its own specialisation
    other = compile._stand_ins(
        page_size=64, host_layout="page_first", num_layers=3, kv_dim=656, kv_dtype=torch.uint8,
        indexer_page_bytes=None, device=torch.device("cpu"), pin_memory=False,
    )
    locs64 = torch.arange(64, dtype=torch.int64)
    assert key(other[0].plan, locs64, locs64, CpPlacement(64, 1, 0)) != key(
        stand_ins[0].plan, locs64[:16], locs64[:16], CpPlacement(16, 1, 0)
    )
