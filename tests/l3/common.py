"""Shared builders for the L3 tests: namespaces, page hash chains, payloads."""

from __future__ import annotations

import hashlib
import struct

import torch

from sglang_cp_hicache.l3.keys import L3Namespace


def namespace(**overrides) -> L3Namespace:
    """A small DSA-like KV namespace (tiny pages keep the tests fast)."""
    fields = dict(model_id="tiny/dsa", kv_dtype="float8_e4m3fn", row_bytes=656,
                  page_size=4, pool="kv", layer_start=0, layer_end=3)
    fields.update(overrides)
    return L3Namespace(**fields)


def hash_chain(num_pages: int, seed: int = 0, page_size: int = 4) -> list[str]:
    """A page hash chain shaped like SGLang's: d_i = SHA256(d_{i-1} || tokens LE u32)."""
    out: list[str] = []
    prev = b""
    for i in range(num_pages):
        tokens = [(seed * 1_000_003 + i * page_size + t) % 2**32 for t in range(page_size)]
        digest = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *tokens))
        out.append(digest.hexdigest())
        prev = digest.digest()
    return out


def payload(ns: L3Namespace, seed: int) -> torch.Tensor:
    """Random page bytes of ``ns``'s exact size."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (ns.page_bytes,), dtype=torch.uint8, generator=gen)
