"""Page keys: topology-free, one digest per byte-defining namespace, stable
across processes, strict on input."""

import dataclasses
import hashlib
import inspect
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.l3.auth import ObjectSeal
from sglang_cp_hicache.l3.keys import (
    KEY_CHARS,
    L3Namespace,
    check_page_hash,
    check_page_key,
    page_key,
    page_keys,
    split_page_key,
)
from sglang_cp_hicache.l3.plan import interleaved_owners, write_plan
from tests.l3.common import hash_chain, namespace

DSV32 = dict(model_id="deepseek-ai/DeepSeek-V3.2", kv_dtype="float8_e4m3fn", row_bytes=656,
             page_size=64, pool="kv", layer_start=0, layer_end=61)
# Known vectors: these digests are what every process, platform and Python
# version must compute; a change here orphans every stored object.
# schema 3 (the object seal's scheme); schema 2 (the model identity) was
# ef4d8e8602811a40, schema 1 b41d6c1dcf49f606
DSV32_DIGEST = "9975222420546907"
DSV32_CANONICAL = (
    '{"byte_order":"LPD","kv_dtype":"float8_e4m3fn","layer_end":61,"layer_start":0,'
    '"model_id":"deepseek-ai/DeepSeek-V3.2","page_size":64,"pool":"kv","row_bytes":656,'
    '"schema_version":3,"seal":"xxh3-64"}'
)
NAMESPACE_FIELDS = {"model_id", "kv_dtype", "row_bytes", "page_size", "pool",
                    "layer_start", "layer_end", "byte_order", "schema_version", "seal"}


def test_known_vector_and_its_canonical_encoding():
    ns = L3Namespace(**DSV32)
    assert ns.digest() == DSV32_DIGEST
    assert hashlib.sha256(DSV32_CANONICAL.encode()).hexdigest()[:16] == DSV32_DIGEST
    assert page_key("0" * 64, ns) == "0" * 64 + "_" + DSV32_DIGEST + "_root"
    assert page_key("0" * 64, ns, "ab" * 32) == "0" * 64 + "_" + DSV32_DIGEST + "_" + "ab" * 8
    assert ns.page_bytes == 61 * 64 * 656


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_digest_is_the_same_in_another_process(seed):
    code = ("from sglang_cp_hicache.l3.keys import L3Namespace;"
            f"print(L3Namespace(**{DSV32!r}).digest())")
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == DSV32_DIGEST


def test_no_topology_input_exists():
    init_fields = {f.name for f in dataclasses.fields(L3Namespace) if f.init}
    assert init_fields == NAMESPACE_FIELDS
    # the parent is the chain link (the page before), never a rank or size
    assert list(inspect.signature(page_key).parameters) == ["page_hash", "namespace", "parent"]
    assert list(inspect.signature(page_keys).parameters) == ["page_hashes", "namespace", "first_parent"]
    with pytest.raises(TypeError):
        L3Namespace(**DSV32, cp_rank=0)


@given(num_pages=st.integers(0, 24), cp_size=st.integers(1, 8), base=st.integers(0, 63),
       seed=st.integers(0, 1000))
def test_keys_written_by_any_cp_size_are_the_non_cp_keys(num_pages, cp_size, base, seed):
    ns = namespace()
    hashes = hash_chain(num_pages, seed)
    reference = page_keys(hashes, ns)  # CP 1 / no CP
    owners = interleaved_owners(base, num_pages, cp_size)
    plans = [write_plan(page_keys(hashes, ns), owners, cp_size, r) for r in range(cp_size)]
    by_page = {}
    for plan in plans:
        for index, key in zip(plan.page_indices, plan.keys):
            assert index not in by_page
            by_page[index] = key
    assert [by_page[i] for i in range(num_pages)] == reference


def _other_value(field: str, value, pick: int):
    if field == "model_id":
        return value + ("x" if pick % 2 else "/2")
    if field == "kv_dtype":
        return ["bfloat16", "uint8", "float16"][pick % 3]
    if field == "pool":
        return "indexer"
    if field == "byte_order":
        return "PLD"
    if field == "row_bytes":
        return [576, 1152, 132][pick % 3]
    if field == "seal":
        return ObjectSeal.keyed(bytes([pick]) * 32)  # the scheme changes the digest (the secret does not)
    return value + 1 + pick  # page_size, layer_start/end, schema_version


@given(field=st.sampled_from(sorted(NAMESPACE_FIELDS)), pick=st.integers(0, 5))
def test_any_field_change_changes_the_digest(field, pick):
    base = L3Namespace(**DSV32)
    changed = {**DSV32, field: _other_value(field, getattr(base, field), pick)}
    if field == "layer_start":
        changed["layer_end"] = changed["layer_start"] + 61
    other = L3Namespace(**changed)
    assert other != base
    assert other.digest() != base.digest()
    assert page_key("a" * 64, other) != page_key("a" * 64, base)


def test_dtype_spellings_share_one_namespace():
    spellings = ["float16", "torch.float16", "half", torch.float16]
    digests = {namespace(kv_dtype=s, row_bytes=1152).digest() for s in spellings}
    assert len(digests) == 1
    assert namespace(kv_dtype=torch.float16, row_bytes=1152).kv_dtype == "float16"


@pytest.mark.parametrize("value", ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "", " " + "a" * 63, None, 7])
def test_bad_page_hash_names_the_argument(value):
    with pytest.raises((TypeError, ValueError), match="page_hash"):
        page_key(value, namespace())


def test_bad_hash_in_a_chain_names_its_index():
    hashes = hash_chain(3)
    hashes[2] = hashes[2].upper()
    with pytest.raises(ValueError, match=r"page_hashes\[2\]"):
        page_keys(hashes, namespace())
    with pytest.raises(TypeError, match="page_hashes"):
        page_keys("a" * 64, namespace())
    with pytest.raises(TypeError, match="namespace"):
        page_key("a" * 64, DSV32)


@pytest.mark.parametrize(
    "change, word",
    [
        (dict(model_id=""), "model_id"),
        (dict(model_id=" m"), "model_id"),
        (dict(model_id=3), "model_id"),
        (dict(kv_dtype="fp8"), "kv_dtype"),
        (dict(kv_dtype="Tensor"), "kv_dtype"),
        (dict(row_bytes=0), "row_bytes"),
        (dict(row_bytes=True), "row_bytes"),
        (dict(kv_dtype="bfloat16", row_bytes=655), "row_bytes"),
        (dict(page_size=0), "page_size"),
        (dict(pool="KV"), "pool"),
        (dict(layer_start=-1), "layer_start"),
        (dict(layer_end=0), "layer_end"),
        (dict(layer_start=3, layer_end=3), "layer_end"),
        (dict(byte_order="DLP"), "byte_order"),
        (dict(schema_version=0), "schema_version"),
    ],
)
def test_bad_namespace_field_names_the_argument(change, word):
    with pytest.raises((TypeError, ValueError), match=word):
        namespace(**change)


def test_page_key_checks_and_split():
    ns = namespace()
    key = page_key("b" * 64, ns)
    linked = page_key("b" * 64, ns, "c" * 64)
    assert len(linked) == KEY_CHARS and len(key) < KEY_CHARS
    assert split_page_key("key", key) == ("b" * 64, ns.digest(), "root")
    assert split_page_key("key", linked) == ("b" * 64, ns.digest(), "c" * 16)
    assert check_page_key("key", linked, ns) == linked
    assert check_page_key("key", key, ns) == key
    assert check_page_hash("h", "c" * 64) == "c" * 64
    with pytest.raises(ValueError, match="not a key of namespace"):
        check_page_key("key", key, namespace(page_size=8))
    for bad in ["b" * 64, "b" * 64 + "_" + "0" * 15, "b" * 64 + "-" + ns.digest(), "../" + key[3:],
                "b" * 64 + "_" + ns.digest(), key + "_x", linked[:-1], key.replace("root", "ROOT")]:
        with pytest.raises(ValueError, match="key"):
            check_page_key("key", bad)
    with pytest.raises(TypeError, match="key"):
        check_page_key("key", b"x")
