"""Deterministic KV + indexer content for DSA device pools, checked bit-exactly.

Pure torch (no SGLang import): the functions take any object shaped like
SGLang's ``DSATokenToKVPool`` -- ``kv_buffer[layer]`` ``(slots, 1, dim)``,
``index_k_with_scale_buffer[layer]`` page-major ``(pages, P * (key + scale))``
uint8, plus ``page_size``, ``layer_num``, ``index_head_dim`` and
``quant_block_size``.

A token's bytes are a pure function of ``(content key, seed, layer, part)``.
The *content key* is whatever identifies what the token must hold: the tests
pass plain positions, the simulator passes :func:`prefix_keys` (a rolling hash
of every token id up to and including the token, so the key encodes both the
position and the whole prefix). Bytes can then be checked wherever a page has
moved to. Every comparison is bitwise (``uint8`` views, ``torch.equal``), so a
bf16 NaN pattern compares equal to itself and nothing is compared with a
tolerance.

Indexer bytes of one token: its ``index_head_dim`` fp8 key bytes at
``offset * key_bytes`` in its page row, and its fp32 scale bytes after all
``P`` keys of the page (``P * key_bytes + offset * scale_bytes``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = [
    "KEY_MODULUS",
    "POISON_BYTE",
    "content_mismatches",
    "corrupted_token_mask",
    "expected_rows",
    "pattern_bytes",
    "poison_device",
    "poisoned_elsewhere",
    "prefix_keys",
    "read_rows",
    "row_widths",
    "rows_differ",
    "token_positions",
    "write_content",
    "write_rows",
]

POISON_BYTE = 0xA5
#: Content keys live in [0, KEY_MODULUS): a prime below 2**31, so every
#: intermediate of :func:`pattern_bytes` stays far from int64 overflow.
KEY_MODULUS = 2_147_483_647
_KEY_BASE = 1_000_003

_PART_KV, _PART_INDEX_K, _PART_INDEX_SCALE = 1, 2, 3


def prefix_keys(token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
    """int64 content key per token: a polynomial rolling hash (mod a 31-bit
    prime) of token ids ``[0..i]``. Two tokens share a key only if they have
    the same position and (up to hash collisions) the same prefix.
    ``start``: the key of the token before ``token_ids[0]`` (0: they start
    the sequence), so a node's keys follow from its parent's last key:
    ``prefix_keys(a + b)[len(a):] == prefix_keys(b, start=prefix_keys(a)[-1])``."""
    keys = [0] * len(token_ids)
    h = int(start)
    for i, token in enumerate(token_ids):
        h = (h * _KEY_BASE + (int(token) & 0xFFFFFFFF) + 1) % KEY_MODULUS
        keys[i] = h
    return torch.tensor(keys, dtype=torch.int64)


def pattern_bytes(positions: torch.Tensor, width: int, *, seed: int, layer: int, part: int) -> torch.Tensor:
    """``(len(positions), width)`` uint8: a mixing hash of (key, byte, seed, layer, part).

    The hash, on exact integers: ``x = (key * 1_000_003 + byte * 7_919 +
    salt) mod 2**31``; ``x ^= x >> 7``; ``x = x * 2_654_435_761 mod 2**32``;
    ``x ^= x >> 15``; the low byte of ``x``. ``positions`` are content keys
    in ``[0, 2**31)`` (higher bits are dropped).

    CPU tensors take 32-bit unsigned arithmetic (numpy's wrap-around is
    modulo 2**32, and 2**31 divides it, so every step is the same number as
    on exact integers) with in-place steps: a quarter of the memory traffic
    of the 64-bit form, which any other device runs.
    """
    if positions.device.type != "cpu":
        return _pattern_bytes_int64(positions, width, seed=seed, layer=layer, part=part)
    salt = (seed * 104_729 + layer * 4_099 + part * 613) & 0x7FFFFFFF
    return _mix_rows(positions, np.arange(width, dtype=np.uint32) * np.uint32(7_919) + np.uint32(salt))


#: Rows hashed per block: a block's uint32 scratch stays in a core's cache
#: across the in-place steps (whole-array passes are bound by memory traffic).
_BLOCK_ROWS = 128


def _mix_rows(positions: torch.Tensor, columns: np.ndarray) -> torch.Tensor:
    """uint8 ``(len(positions), len(columns))``: :func:`pattern_bytes`' hash
    of each row's key with each column's ``byte * 7_919 + salt`` (uint32)."""
    pos = (positions.to(torch.int64) & 0x7FFFFFFF).numpy().astype(np.uint32)
    row = pos * np.uint32(1_000_003)
    out = np.empty((pos.size, columns.size), dtype=np.uint8)
    scratch = np.empty((min(_BLOCK_ROWS, pos.size), columns.size), dtype=np.uint32)
    shifted = np.empty_like(scratch)
    for start in range(0, pos.size, _BLOCK_ROWS):
        x, tmp = scratch[: min(_BLOCK_ROWS, pos.size - start)], shifted[: min(_BLOCK_ROWS, pos.size - start)]
        np.add(row[start: start + x.shape[0], None], columns[None, :], out=x)
        x &= np.uint32(0x7FFFFFFF)
        np.right_shift(x, np.uint32(7), out=tmp)
        x ^= tmp
        x *= np.uint32(2_654_435_761)
        np.right_shift(x, np.uint32(15), out=tmp)
        x ^= tmp
        np.copyto(out[start: start + x.shape[0]], x, casting="unsafe")  # the low byte
    return torch.from_numpy(out)


def _pattern_bytes_int64(positions: torch.Tensor, width: int, *, seed: int, layer: int, part: int) -> torch.Tensor:
    """:func:`pattern_bytes` in 64-bit torch arithmetic, on any device: every
    product stays below 2**63 (no reliance on integer wrap-around)."""
    pos = (positions.to(torch.int64) & 0x7FFFFFFF).reshape(-1, 1)
    col = torch.arange(width, dtype=torch.int64, device=positions.device).reshape(1, -1)
    salt = (seed * 104_729 + layer * 4_099 + part * 613) & 0x7FFFFFFF
    x = (pos * 1_000_003 + col * 7_919 + salt) & 0x7FFFFFFF
    x = x ^ (x >> 7)
    x = (x * 2_654_435_761) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8)


def _kv_bytes(kv_pool: Any, layer: int) -> torch.Tensor:
    return kv_pool.kv_buffer[layer].view(torch.uint8)  # (slots, 1, row_bytes)


def _index_geometry(kv_pool: Any) -> tuple[int, int]:
    key_bytes = kv_pool.index_head_dim  # fp8 keys: one byte each
    scale_bytes = kv_pool.index_head_dim // kv_pool.quant_block_size * 4  # fp32 scales
    return key_bytes, scale_bytes


def _index_cells(kv_pool: Any, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row and column indices of each token's indexer key bytes and scale bytes."""
    page_size = kv_pool.page_size
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    page = (locs // page_size).reshape(-1, 1)
    offset = (locs % page_size).reshape(-1, 1)
    key_cols = offset * key_bytes + torch.arange(key_bytes).reshape(1, -1)
    scale_cols = page_size * key_bytes + offset * scale_bytes + torch.arange(scale_bytes).reshape(1, -1)
    return page, key_cols, scale_cols


def _check_lengths(locs: torch.Tensor, positions: torch.Tensor) -> None:
    if locs.numel() != positions.numel():
        raise ValueError(f"locs ({locs.numel()}) and positions ({positions.numel()}) differ in length")


def _kv_rows(kv_pool: Any, layer: int) -> torch.Tensor:
    return _kv_bytes(kv_pool, layer)[:, 0]  # (slots, row_bytes), a view


def _index_rows(kv_pool: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(pages, P, key_bytes)`` and ``(pages, P, scale_bytes)`` of a
    layer's indexer buffer: a token's cells are ``[page, offset]`` of each."""
    index = kv_pool.index_k_with_scale_buffer[layer]
    P = kv_pool.page_size
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    page_stride, col = index.stride()
    keys = torch.as_strided(index, (index.shape[0], P, key_bytes), (page_stride, key_bytes * col, col),
                            index.storage_offset())
    scales = torch.as_strided(index, (index.shape[0], P, scale_bytes), (page_stride, scale_bytes * col, col),
                              index.storage_offset() + P * key_bytes * col)
    return keys, scales


def row_widths(kv_pool: Any) -> list[int]:
    """Byte widths of a token's row parts, in :func:`read_rows` order: per
    layer its KV row, its indexer key bytes, its indexer scale bytes."""
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    return [w for layer in range(kv_pool.layer_num) for w in (_kv_bytes(kv_pool, layer).shape[-1], key_bytes,
                                                               scale_bytes)]


def expected_rows(kv_pool: Any, positions: torch.Tensor, *, seed: int) -> torch.Tensor:
    """uint8 ``(len(positions), sum(row_widths))``: every byte
    :func:`write_content` writes for each key, in :func:`read_rows` order
    (one hash pass over all layers and parts)."""
    if positions.device.type != "cpu":
        parts = [pattern_bytes(positions, w, seed=seed, layer=i // 3, part=_PARTS[i % 3])
                 for i, w in enumerate(row_widths(kv_pool))]
        return torch.cat(parts, dim=1)
    columns = [np.arange(w, dtype=np.uint32) * np.uint32(7_919)
               + np.uint32((seed * 104_729 + (i // 3) * 4_099 + _PARTS[i % 3] * 613) & 0x7FFFFFFF)
               for i, w in enumerate(row_widths(kv_pool))]
    return _mix_rows(positions, np.concatenate(columns))


_PARTS = (_PART_KV, _PART_INDEX_K, _PART_INDEX_SCALE)


def _widest(view: torch.Tensor) -> torch.Tensor:
    """The same bytes seen through the widest integer type their shape,
    strides and offset allow: a row gather then moves words, not bytes."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if view.shape[-1] % size == 0 and view.storage_offset() % size == 0 and all(
                stride % size == 0 for stride in view.stride()[:-1]):
            return view.view(dtype)
    return view


def _row_targets(kv_pool: Any) -> list[tuple[torch.Tensor, bool]]:
    """Each part of a token's row, in :func:`read_rows` order, as (widest
    view, by slot): by slot a ``(slots, w)`` view, else ``(pages, P, w)``."""
    targets = []
    for layer in range(kv_pool.layer_num):
        keys, scales = _index_rows(kv_pool, layer)
        targets += [(_widest(_kv_rows(kv_pool, layer)), True), (_widest(keys), False), (_widest(scales), False)]
    return targets


def read_rows(kv_pool: Any, locs: torch.Tensor) -> torch.Tensor:
    """uint8 ``(len(locs), sum(row_widths))``: the bytes physical ``locs`` hold, every layer."""
    locs = locs.to(torch.int64)
    page, offset = locs // kv_pool.page_size, locs % kv_pool.page_size
    parts = [(view.index_select(0, locs) if by_slot else view[page, offset]).view(torch.uint8)
             for view, by_slot in _row_targets(kv_pool)]
    return torch.cat(parts, dim=1)


def write_rows(kv_pool: Any, locs: torch.Tensor, rows: "torch.Tensor | int") -> None:
    """Store ``rows`` (as :func:`read_rows` returns them), or one byte value
    everywhere, at physical ``locs``, every layer."""
    locs = locs.to(torch.int64)
    page, offset = locs // kv_pool.page_size, locs % kv_pool.page_size
    start = 0
    for (view, by_slot), width in zip(_row_targets(kv_pool), row_widths(kv_pool)):
        if isinstance(rows, int):  # one byte everywhere: through the byte view
            target = view.view(torch.uint8)
            if by_slot:
                target.index_fill_(0, locs, rows)
            else:
                target[page, offset] = rows
            continue
        # a fresh copy: its own storage at offset 0, whatever the slice's offset (a one-row slice counts as
        # contiguous in place, and its offset need not suit the wide type)
        value = rows[:, start: start + width].clone(memory_format=torch.contiguous_format).view(view.dtype)
        start += width
        if by_slot:
            view.index_copy_(0, locs, value)
        else:
            view[page, offset] = value


def rows_differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Bool per row: True where any byte of ``got`` differs from ``want``."""
    if torch.equal(got, want):
        return torch.zeros(got.shape[0], dtype=torch.bool)
    return (_widest(got) != _widest(want)).any(dim=1)


def write_content(kv_pool: Any, locs: torch.Tensor, positions: torch.Tensor, *, seed: int) -> None:
    """Fill the KV rows and indexer key/scale bytes of physical ``locs``
    with the content of ``positions`` (content keys), every layer."""
    _check_lengths(locs, positions)
    if locs.numel() == 0:
        return
    write_rows(kv_pool, locs, expected_rows(kv_pool, positions, seed=seed))


def corrupted_token_mask(kv_pool: Any, locs: torch.Tensor, positions: torch.Tensor, *, seed: int) -> torch.Tensor:
    """Bool per token: True where any KV or indexer byte of any layer differs
    from the content of its key."""
    _check_lengths(locs, positions)
    if locs.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    return rows_differ(read_rows(kv_pool, locs), expected_rows(kv_pool, positions, seed=seed))


def content_mismatches(kv_pool: Any, locs: torch.Tensor, positions: torch.Tensor, *, seed: int) -> list[str]:
    """Every ``"kv[layer]"`` / ``"index_k[layer]"`` / ``"index_scale[layer]"`` whose bytes differ."""
    _check_lengths(locs, positions)
    locs = locs.to(torch.int64)
    key_bytes, scale_bytes = _index_geometry(kv_pool)
    page, key_cols, scale_cols = _index_cells(kv_pool, locs)
    bad = []
    for layer in range(kv_pool.layer_num):
        kv = _kv_bytes(kv_pool, layer)
        want = pattern_bytes(positions, kv.shape[-1], seed=seed, layer=layer, part=_PART_KV)
        if not torch.equal(kv[locs, 0], want):
            bad.append(f"kv[{layer}]")
        index = kv_pool.index_k_with_scale_buffer[layer]
        want = pattern_bytes(positions, key_bytes, seed=seed, layer=layer, part=_PART_INDEX_K)
        if not torch.equal(index[page, key_cols], want):
            bad.append(f"index_k[{layer}]")
        want = pattern_bytes(positions, scale_bytes, seed=seed, layer=layer, part=_PART_INDEX_SCALE)
        if not torch.equal(index[page, scale_cols], want):
            bad.append(f"index_scale[{layer}]")
    return bad


def poison_device(kv_pool: Any, byte: int = POISON_BYTE) -> None:
    """Overwrite every device KV and indexer byte (padding page included)."""
    for layer in range(kv_pool.layer_num):
        _kv_bytes(kv_pool, layer).fill_(byte)
        kv_pool.index_k_with_scale_buffer[layer].fill_(byte)


def poisoned_elsewhere(kv_pool: Any, written_locs: torch.Tensor, byte: int = POISON_BYTE) -> list[str]:
    """Buffers holding a non-poison byte outside ``written_locs`` (and their pages)."""
    written_locs = written_locs.to(torch.int64)
    bad = []
    for layer in range(kv_pool.layer_num):
        kv = _kv_bytes(kv_pool, layer)
        keep = torch.ones(kv.shape[0], dtype=torch.bool)
        keep[written_locs] = False
        if not bool((kv[keep] == byte).all()):
            bad.append(f"kv[{layer}]")
        index = kv_pool.index_k_with_scale_buffer[layer]
        keep = torch.ones(index.shape[0], dtype=torch.bool)
        keep[torch.unique(written_locs // kv_pool.page_size)] = False
        if not bool((index[keep] == byte).all()):
            bad.append(f"index[{layer}]")
    return bad


def token_positions(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64)
