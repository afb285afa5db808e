"""The stored object: round trips bit-exact; every corruption is refused with
its reason; never raises on corrupt data, never returns wrong bytes."""

import random
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.l3.envelope import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_FIELDS,
    MAGIC,
    Rejection,
    pack,
    unpack,
)
from sglang_cp_hicache.l3.keys import page_key
from tests.l3.common import namespace, payload

NS = namespace()
KEY = page_key("1" * 64, NS)


def _blob(seed: int = 0) -> tuple[bytes, torch.Tensor]:
    data = payload(NS, seed)
    return pack(KEY, NS, data), data


def _flip(blob: bytes, bit: int) -> bytes:
    out = bytearray(blob)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _reason(result) -> str:
    assert isinstance(result, Rejection), "corrupt object accepted"
    return result.reason


@given(seed=st.integers(0, 2**31), layers=st.integers(1, 4), page_size=st.integers(1, 9),
       row_bytes=st.sampled_from([1, 132, 576, 656]))
def test_round_trip_is_bit_exact(seed, layers, page_size, row_bytes):
    ns = namespace(layer_end=layers, page_size=page_size, row_bytes=row_bytes)
    key = page_key(f"{seed:064x}", ns)
    data = payload(ns, seed)
    blob = pack(key, ns, data)
    assert len(blob) == HEADER_BYTES + ns.page_bytes
    for form in (blob, bytearray(blob), memoryview(blob)):
        out = unpack(key, ns, form)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8
        assert torch.equal(out, data)
    assert torch.equal(data, payload(ns, seed))  # the source is untouched


def test_the_returned_page_is_a_private_copy():
    blob, data = _blob()
    buf = bytearray(blob)
    out = unpack(KEY, NS, buf)
    buf[HEADER_BYTES:] = bytes(len(buf) - HEADER_BYTES)
    assert torch.equal(out, data)
    out[0] ^= 0xFF  # writable, and the caller's buffer does not change
    assert buf[HEADER_BYTES] == 0


def test_header_layout_is_what_the_docstring_says():
    blob, data = _blob()
    assert blob[:8] == MAGIC
    assert struct.unpack_from("<H", blob, 8) == (FORMAT_VERSION,)
    start, end = HEADER_FIELDS["key"]
    assert blob[start:end] == KEY.encode().ljust(end - start, b"\0")  # NUL-padded (a root page's key is shorter)
    start, end = HEADER_FIELDS["namespace"]
    assert blob[start:end] == NS.digest().encode()
    start, _ = HEADER_FIELDS["payload_len"]
    assert struct.unpack_from("<Q", blob, start) == (NS.page_bytes,)
    assert HEADER_FIELDS["tag"][1] == HEADER_BYTES


def _expected_for_header_flip(field: str, bit_in_field: int) -> str:
    if field in ("magic", "version"):
        return "magic"
    if field == "payload_len":
        # The declared length grows (bit was 0) or shrinks: the payload that
        # follows is then shorter or longer than declared.
        declared = NS.page_bytes ^ (1 << bit_in_field)
        return "short" if declared > NS.page_bytes else "long"
    return {"namespace": "namespace", "key": "key", "tag": "checksum"}[field]


def test_every_header_bit_flip_is_refused_with_its_reason():
    blob, _ = _blob()
    for field, (start, end) in HEADER_FIELDS.items():
        for bit in range(start * 8, end * 8):
            got = _reason(unpack(KEY, NS, _flip(blob, bit)))
            assert got == _expected_for_header_flip(field, bit - start * 8), (field, bit)


@given(bit=st.integers(0, NS.page_bytes * 8 - 1))
def test_any_payload_bit_flip_is_a_checksum_rejection(bit):
    blob, _ = _blob()
    assert _reason(unpack(KEY, NS, _flip(blob, HEADER_BYTES * 8 + bit))) == "checksum"


def test_every_payload_byte_and_bit_position_class():
    blob, _ = _blob(3)
    for byte in (0, 1, NS.page_bytes // 2, NS.page_bytes - 1):
        for bit in range(8):
            assert _reason(unpack(KEY, NS, _flip(blob, (HEADER_BYTES + byte) * 8 + bit))) == "checksum"


def test_truncation_at_every_boundary_class_is_short():
    blob, _ = _blob()
    cuts = {0, 1, 7, 8, 9, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1,
            HEADER_BYTES + NS.page_bytes // 2, len(blob) - 1}
    cuts |= {start for start, _ in HEADER_FIELDS.values()} | {end for _, end in HEADER_FIELDS.values()}
    for cut in sorted(cuts):
        if cut < len(blob):
            assert _reason(unpack(KEY, NS, blob[:cut])) == "short", cut


@pytest.mark.parametrize("extra", [1, 7, HEADER_BYTES, 4096])
def test_extra_bytes_are_long(extra):
    blob, _ = _blob()
    assert _reason(unpack(KEY, NS, blob + b"\0" * extra)) == "long"


def test_a_declared_length_that_is_not_the_page_size_is_refused():
    # Consistent header and body, but not a page of this namespace.
    blob, _ = _blob()
    start, end = HEADER_FIELDS["payload_len"]
    shorter = bytearray(blob[: len(blob) - 1])
    shorter[start:end] = struct.pack("<Q", NS.page_bytes - 1)
    assert _reason(unpack(KEY, NS, bytes(shorter))) == "short"
    longer = bytearray(blob + b"\0")
    longer[start:end] = struct.pack("<Q", NS.page_bytes + 1)
    assert _reason(unpack(KEY, NS, bytes(longer))) == "long"


def test_missing_empty_other_namespace_other_key_and_garbage():
    blob, data = _blob()
    assert _reason(unpack(KEY, NS, None)) == "missing"
    assert _reason(unpack(KEY, NS, b"")) == "short"
    other_ns = namespace(model_id="other/model")
    other_key = page_key("1" * 64, other_ns)
    assert _reason(unpack(other_key, other_ns, blob)) == "namespace"
    assert _reason(unpack(page_key("2" * 64, NS), NS, blob)) == "key"
    # Same page size, other namespace: its object under our key is still refused.
    foreign = pack(other_key, other_ns, data)
    assert _reason(unpack(KEY, NS, foreign)) == "namespace"
    assert _reason(unpack(KEY, NS, b"\0" * len(blob))) == "magic"
    assert _reason(unpack(KEY, NS, random.Random(9).randbytes(len(blob)))) == "magic"


def test_a_payload_swapped_between_pages_of_one_namespace_is_refused_by_key():
    a = pack(KEY, NS, payload(NS, 1))
    key_b = page_key("2" * 64, NS)
    b = pack(key_b, NS, payload(NS, 2))
    assert _reason(unpack(key_b, NS, a)) == "key"
    assert _reason(unpack(KEY, NS, b)) == "key"
    spliced = a[:HEADER_BYTES] + b[HEADER_BYTES:]  # right header, other page's bytes
    assert _reason(unpack(KEY, NS, spliced)) == "checksum"


@pytest.mark.parametrize(
    "bad, word, kind",
    [
        (lambda: torch.zeros(NS.page_bytes, dtype=torch.int8), "payload", ValueError),
        (lambda: torch.zeros(NS.page_bytes - 1, dtype=torch.uint8), "payload", ValueError),
        (lambda: torch.zeros(2, NS.page_bytes, dtype=torch.uint8)[:, 0], "payload", ValueError),
        (lambda: bytes(NS.page_bytes), "payload", TypeError),
    ],
)
def test_pack_refuses_bad_payloads(bad, word, kind):
    with pytest.raises(kind, match=word):
        pack(KEY, NS, bad())


def test_pack_and_unpack_refuse_bad_keys_and_namespaces():
    data = payload(NS, 0)
    with pytest.raises(ValueError, match="key"):
        pack(page_key("1" * 64, namespace(page_size=8)), NS, data)
    with pytest.raises(TypeError, match="namespace"):
        pack(KEY, object(), data)
    with pytest.raises(ValueError, match="expected_key"):
        unpack("1" * 64, NS, b"")
    with pytest.raises(TypeError, match="expected_namespace"):
        unpack(KEY, None, b"")
    with pytest.raises(TypeError, match="blob"):
        unpack(KEY, NS, "text")


def test_pack_accepts_a_page_in_any_contiguous_shape():
    data = payload(NS, 5)
    blob = pack(KEY, NS, data.view(NS.num_layers, NS.page_size, NS.row_bytes))
    assert torch.equal(unpack(KEY, NS, blob), data)


def test_check_object_verifies_buffers_read_in_place():
    """What a scatter read fills: the header's buffer and the payload's own."""
    from sglang_cp_hicache.l3.envelope import check_object, header

    data = payload(NS, 7)
    head = header(KEY, NS, data)
    buf = bytearray(data.numpy().tobytes())
    assert check_object(KEY, NS, memoryview(head), memoryview(buf)) is None
    assert check_object(KEY, NS, memoryview(head), memoryview(buf)[:-1]).reason == "short"
    buf[5] ^= 1
    assert check_object(KEY, NS, memoryview(head), memoryview(buf)).reason == "checksum"
    other = page_key("2" * 64, NS)
    assert check_object(other, NS, memoryview(head), memoryview(bytes(buf))).reason == "key"
    assert check_object(KEY, NS, memoryview(head[:-1]), memoryview(bytes(buf))).reason == "short"


def test_an_old_format_object_is_never_a_page():
    """Version 1 (CRC-32, keys without the parent link): refused by its
    version, never read as a page."""
    blob, _ = _blob()
    old = bytearray(blob)
    struct.pack_into("<H", old, 8, 1)
    assert _reason(unpack(KEY, NS, bytes(old))) == "magic"
