"""The row-level content functions (one hash pass over every layer and part,
word-wide gathers) give exactly the bytes of the per-part functions, and
the scheduler harness's forward stand-in, which reuses a request's expected
bytes from chunk to chunk, still reads and checks every prefix row each
time: a byte flipped after a chunk fails the next one."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_cp_hicache.testing.content import (
    POISON_BYTE,
    corrupted_token_mask,
    expected_rows,
    pattern_bytes,
    prefix_keys,
    read_rows,
    write_content,
    write_rows,
)
from sglang_cp_hicache.testing.sched_forward import ForwardMismatch, ForwardStandIn

P, PAGES = 64, 6


def _pool(kv_bytes: int, layers: int = 2) -> types.SimpleNamespace:
    """Shaped like SGLang's DSATokenToKVPool: bf16 rows (0.5.18, 1,152 bytes) or fp8 (0.5.23, 576)."""
    dtype = torch.bfloat16 if kv_bytes == 1152 else torch.float8_e4m3fn
    g = torch.Generator().manual_seed(kv_bytes)
    kv = [torch.randint(0, 256, (PAGES * P, 1, kv_bytes), dtype=torch.uint8, generator=g).view(dtype)
          for _ in range(layers)]
    index = [torch.randint(0, 256, (PAGES, P * (128 + 4)), dtype=torch.uint8, generator=g) for _ in range(layers)]
    return types.SimpleNamespace(page_size=P, layer_num=layers, index_head_dim=128, quant_block_size=128,
                                 kv_buffer=kv, index_k_with_scale_buffer=index)


@pytest.mark.parametrize("kv_bytes", [1152, 576])
def test_rows_are_the_per_part_bytes_and_one_flipped_bit_anywhere_is_caught(kv_bytes):
    pool = _pool(kv_bytes)
    keys = prefix_keys(list(range(300)))
    for n in (1, 3, 300):  # one row: a slice whose offset does not suit a wide view
        locs = torch.randperm(PAGES * P, generator=torch.Generator().manual_seed(n))[:n]
        want = expected_rows(pool, keys[:n], seed=5)
        parts = [pattern_bytes(keys[:n], w, seed=5, layer=layer, part=part)
                 for layer in range(2) for part, w in ((1, kv_bytes), (2, 128), (3, 4))]
        assert torch.equal(want, torch.cat(parts, dim=1))
        write_content(pool, locs, keys[:n], seed=5)
        assert torch.equal(read_rows(pool, locs), want)
        # the bytes where write_content puts them, read the old way
        layer1 = pool.kv_buffer[1].view(torch.uint8)[locs, 0]
        assert torch.equal(layer1, parts[3])
        cells = pool.index_k_with_scale_buffer[0][locs // P]
        offsets = (locs % P).reshape(-1, 1)
        assert torch.equal(cells.gather(1, offsets * 128 + torch.arange(128)), parts[1])
        assert torch.equal(cells.gather(1, P * 128 + offsets * 4 + torch.arange(4)), parts[2])
        assert not corrupted_token_mask(pool, locs, keys[:n], seed=5).any()
    locs = torch.arange(0, 3 * P, 7)[:20]
    write_content(pool, locs, keys[:20], seed=5)
    pool.kv_buffer[0].view(torch.uint8)[int(locs[2]), 0, kv_bytes - 1] ^= 0x01
    pool.index_k_with_scale_buffer[1][int(locs[9]) // P, (int(locs[9]) % P) * 128 + 5] ^= 0x80
    pool.index_k_with_scale_buffer[0][int(locs[17]) // P, P * 128 + (int(locs[17]) % P) * 4 + 3] ^= 0x10
    assert corrupted_token_mask(pool, locs, keys[:20], seed=5).nonzero().flatten().tolist() == [2, 9, 17]


def test_a_byte_fill_touches_only_its_rows():
    pool = _pool(1152)
    before = read_rows(pool, torch.arange(PAGES * P))
    locs = torch.tensor([0, 5, 64, 200])
    write_rows(pool, locs, POISON_BYTE)
    after = read_rows(pool, torch.arange(PAGES * P))
    assert (after[locs] == POISON_BYTE).all()
    others = torch.ones(PAGES * P, dtype=torch.bool)
    others[locs] = False
    assert torch.equal(after[others], before[others])


class _Mode:
    name = "EXTEND"

    @staticmethod
    def is_extend() -> bool:
        return True


def _chunk(req, prefix: int, extend: int, locs: torch.Tensor) -> types.SimpleNamespace:
    ids = req.origin_input_ids[prefix: prefix + extend]
    return types.SimpleNamespace(forward_mode=_Mode(), seq_lens_cpu=torch.tensor([prefix + extend]),
                                 prefix_lens=[prefix], extend_lens=[extend], input_ids=torch.tensor(ids),
                                 out_cache_loc=locs[prefix: prefix + extend], reqs=[req],
                                 req_pool_indices=torch.tensor([0]))


def test_the_stand_in_reads_every_prefix_row_again_on_every_chunk():
    pool = _pool(1152)
    locs = torch.randperm(PAGES * P, generator=torch.Generator().manual_seed(3))[: 3 * P]
    req_to_token = torch.zeros(1, 4 * P, dtype=torch.int64)
    req_to_token[0, : 3 * P] = locs
    fwd = ForwardStandIn(0, pool, req_to_token, None, gate=lambda report: None)
    req = types.SimpleNamespace(rid="r0", origin_input_ids=list(range(100, 100 + 3 * P)), output_ids=[],
                                finished=lambda: False)
    fwd.next_tokens(_chunk(req, 0, P, locs))
    fwd.next_tokens(_chunk(req, P, P, locs))
    assert (fwd.stats.written, fwd.stats.verified) == (2 * P, P)
    pool.index_k_with_scale_buffer[1][int(locs[70]) // P, P * 128 + (int(locs[70]) % P) * 4] ^= 0x01
    with pytest.raises(ForwardMismatch, match=r"request r0: 1 prefix rows .* first at position 70"):
        fwd.next_tokens(_chunk(req, 2 * P, P, locs))


def test_the_stand_in_derives_afresh_when_a_request_id_comes_back_with_other_tokens():
    pool = _pool(1152)
    locs = torch.arange(2 * P)
    req_to_token = torch.zeros(1, 2 * P, dtype=torch.int64)
    req_to_token[0, : 2 * P] = locs
    fwd = ForwardStandIn(0, pool, req_to_token, None, gate=lambda report: None)
    first = types.SimpleNamespace(rid="r0", origin_input_ids=list(range(2 * P)), output_ids=[], finished=lambda: False)
    fwd.next_tokens(_chunk(first, 0, P, locs))
    # same rid, other tokens: the rows hold the first request's content, which is not this prefix's
    other = types.SimpleNamespace(rid="r0", origin_input_ids=list(range(7, 7 + 2 * P)), output_ids=[],
                                  finished=lambda: False)
    with pytest.raises(ForwardMismatch, match="request r0: 64 prefix rows"):
        fwd.next_tokens(_chunk(other, P, P, locs))


def test_the_stand_in_names_a_first_forwards_l3_tail_and_counts_its_checked_rows():
    """--l3 under the scheduler engine: the tail of a request's first prefix restored from L3 is SGLang's
    storage hit on the request, at most what was loaded back for it; later chunks name none."""
    from sglang_cp_hicache.testing.sched_forward import SEED

    pool = _pool(1152)
    locs = torch.arange(4 * P)
    req_to_token = torch.zeros(2, 4 * P, dtype=torch.int64)
    req_to_token[:, : 4 * P] = locs
    reports = []
    fwd = ForwardStandIn(0, pool, req_to_token, None, gate=reports.append)
    tokens = list(range(500, 500 + 4 * P))
    write_content(pool, locs[: 2 * P], prefix_keys(tokens)[: 2 * P], seed=SEED)  # the cached prefix
    req = types.SimpleNamespace(rid="r1", origin_input_ids=tokens, output_ids=[], finished=lambda: False,
                                storage_hit_length=2 * P)
    fwd.host_loaded["r1"] = P  # one of the two restored pages reached the device; the other was computed
    fwd.next_tokens(_chunk(req, P, P, locs))
    fwd.next_tokens(_chunk(req, 2 * P, P, locs))
    assert [r.entries[0].l3_tokens for r in reports] == [P, 0]
    assert (fwd.stats.l3_verified, fwd.stats.verified) == (P, 3 * P)
    # nothing loaded back (a declined load-back): no L3 tail, whatever the storage hit says
    declined = types.SimpleNamespace(rid="r2", origin_input_ids=tokens, output_ids=[], finished=lambda: False,
                                     storage_hit_length=2 * P)
    fwd.next_tokens(_chunk(declined, P, P, locs))
    assert reports[-1].entries[0].l3_tokens == 0 and fwd.stats.l3_verified == P
