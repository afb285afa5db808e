"""Compile the page-copy kernels for Hopper (sm_90) on a machine without a GPU
and dump their PTX. Run as a script by tests/kernels/test_kernels_compile.py, in a
fresh process with a fresh TRITON_CACHE_DIR:

    python tests/helpers/kernels_aot_job.py OUT_DIR

Writes OUT_DIR/<config>__<op>.ptx and OUT_DIR/index.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.backends.compiler import GPUTarget

from sglang_cp_hicache.kernels import compile_offline

# (config name, compile_offline kwargs, expect 16-byte vectors)
CONFIGS = [
    *[
        (f"p64_{hl}_bf16_indexer", dict(page_size=64, host_layout=hl, num_layers=61, kv_dim=576,
                                        kv_dtype=torch.bfloat16, indexer_page_bytes=64 * 132), True)
        for hl in ("layer_first", "page_first", "page_first_direct")
    ],
    *[
        (f"p64_{hl}_fp8", dict(page_size=64, host_layout=hl, num_layers=61, kv_dim=656, kv_dtype=torch.uint8), True)
        for hl in ("layer_first", "page_first", "page_first_direct")
    ],
    ("p16_layer_first_fp8_indexer", dict(page_size=16, host_layout="layer_first", num_layers=4, kv_dim=656,
                                         kv_dtype=torch.uint8, indexer_page_bytes=16 * 132), True),
    # 132-byte indexer pages are only 4-byte aligned: 4-byte words, no vectors
    ("p1_page_first_indexer", dict(page_size=1, host_layout="page_first", num_layers=4,
                                   indexer_page_bytes=132), False),
]


def _tile_bytes(compiled) -> int:
    """Bytes of one tile: TILE_PAGES x TILE_WORDS words (the word is the
    host pointer's element type)."""
    names = list(compiled.src.signature)  # constants are keyed by (argument index,)
    constants = {names[k[0]] if isinstance(k, tuple) else k: v for k, v in compiled.src.constants.items()}
    word = {"*i64": 8, "*i32": 4, "*i16": 2, "*u8": 1}[compiled.src.signature["host_ptr"]]
    return constants["TILE_PAGES"] * constants["TILE_WORDS"] * word


def main(out_dir: str) -> None:
    target = GPUTarget("cuda", 90, 32)
    index = {}
    configs = CONFIGS[:1] if os.environ.get("AOT_JOB_SMALL") else CONFIGS
    for name, kwargs, vectors in configs:
        for op, compiled in compile_offline(target, **kwargs).items():
            path = os.path.join(out_dir, f"{name}__{op}.ptx")
            with open(path, "w") as f:
                f.write(compiled.asm["ptx"])
            index[f"{name}__{op}"] = dict(
                ptx=path, expect_vectors=vectors, cubin_bytes=len(compiled.asm["cubin"]),
                num_warps=compiled.metadata.num_warps, tile_bytes=_tile_bytes(compiled),
            )
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
