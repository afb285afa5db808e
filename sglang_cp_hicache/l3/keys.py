"""Topology-free L3 page keys.

A page key names what a page *is*, never who held it::

    key = "{page_hash}_{namespace digest}_{parent}"

``page_hash`` is SGLang's page hash (the 64-hex SHA-256 prefix chain up to the
end of the page, ``node.hash_value[i]``); the namespace digest covers every
property that changes the page's bytes; ``parent`` is the first 16 hex of the
page hash of the page before it in its chain (``root`` for a chain's first
page). The parent adds nothing to the key's identity -- a page hash already
names its whole prefix, so a page always has the same parent -- but it lets
a store see the chains in its keys alone (a bounded store evicts chains from
their ends). With page interleaving a CP-owned page's bytes equal the bytes a
non-sharded pool holds for it, so nothing about the CP topology enters the
key and deployments of any CP size share one L3.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from sglang_cp_hicache.l3.auth import UNKEYED, ObjectSeal
from sglang_cp_hicache.validation import check_int

__all__ = [
    "BYTE_ORDERS", "DIGEST_CHARS", "KEY_CHARS", "PAGE_HASH_CHARS", "PARENT_CHARS", "ROOT_PARENT", "POOLS",
    "SCHEMA_VERSION", "L3Namespace", "check_page_hash", "check_page_key", "page_key", "page_keys", "split_page_key",
]

#: Version of the namespace encoding and of what its fields mean; a change to
#: either must bump it, so old objects stop matching instead of being misread.
#: 2: the model is its identity (``l3.identity``), no longer the served name.
#: 3: the object seal's scheme (``l3.auth``) is part of the namespace.
SCHEMA_VERSION = 3
PAGE_HASH_CHARS = 64
#: 64 bits of SHA-256: two distinct namespaces collide with probability 2^-64.
DIGEST_CHARS = 16
#: Hex of the parent's page hash in a key (a chain link, not identity).
PARENT_CHARS = 16
ROOT_PARENT = "root"
#: The longest key (a page with a parent).
KEY_CHARS = PAGE_HASH_CHARS + 1 + DIGEST_CHARS + 1 + PARENT_CHARS
POOLS = ("kv", "indexer")
#: Order of a page's bytes on the host: "LPD" (layers, tokens, row; SGLang's
#: layer_first flat page and page_first_direct) is the canonical one; "PLD"
#: (tokens, layers, row) is SGLang's page_first flat page.
BYTE_ORDERS = ("LPD", "PLD")
_HEX = frozenset("0123456789abcdef")
_PAGE_KEY = re.compile(
    rf"([0-9a-f]{{{PAGE_HASH_CHARS}}})_([0-9a-f]{{{DIGEST_CHARS}}})_({ROOT_PARENT}|[0-9a-f]{{{PARENT_CHARS}}})"
)


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and set(text) <= _HEX


def _check_text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value or value != value.strip():
        raise ValueError(f"{name} must be non-empty without surrounding spaces, got {value!r}")
    return value


def _dtype_text(value: object) -> str:
    """Canonical dtype name ("float8_e4m3fn", "bfloat16"): aliases ("half",
    "torch.float16") map to one text, so two adapters never split a namespace
    over spelling."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    name = _check_text("kv_dtype", value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv_dtype must name a torch dtype, got {value!r}")
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class L3Namespace:
    """Everything that makes a stored page's bytes, and nothing about topology.

    ``kv_dtype``: torch dtype name (a ``torch.dtype`` is accepted and stored
    as its name). ``row_bytes``: bytes of one token's row in one layer: the
    row *format*, not only the dtype (DSA KV: 656 scaled FP8, 576 raw FP8,
    1152 bf16). ``layer_start``/``layer_end``: absolute layer range
    ``[start, end)`` held by the page (packed draft layers included).
    ``seal``: how its objects are sealed (``l3.auth``): its scheme enters
    the digest, its secret never does.
    """

    model_id: str
    kv_dtype: str
    row_bytes: int
    page_size: int
    pool: str
    layer_start: int
    layer_end: int
    byte_order: str = "LPD"
    schema_version: int = SCHEMA_VERSION
    seal: ObjectSeal = UNKEYED
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_text("model_id", self.model_id)
        object.__setattr__(self, "kv_dtype", _dtype_text(self.kv_dtype))
        check_int("row_bytes", self.row_bytes, 1)
        check_int("page_size", self.page_size, 1)
        check_int("layer_start", self.layer_start, 0)
        check_int("layer_end", self.layer_end)
        if self.layer_end <= self.layer_start:
            raise ValueError(
                f"layer_end must be > layer_start={self.layer_start}, got {self.layer_end}"
            )
        check_int("schema_version", self.schema_version, 1)
        itemsize = getattr(torch, self.kv_dtype).itemsize
        if self.row_bytes % itemsize:
            raise ValueError(
                f"row_bytes must be a multiple of kv_dtype {self.kv_dtype}'s "
                f"{itemsize} bytes, got {self.row_bytes}"
            )
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.byte_order not in BYTE_ORDERS:
            raise ValueError(f"byte_order must be one of {BYTE_ORDERS}, got {self.byte_order!r}")
        if not isinstance(self.seal, ObjectSeal):
            raise TypeError(f"seal must be an ObjectSeal, got {type(self.seal).__name__}")
        object.__setattr__(self, "_digest", self._compute_digest())

    def _compute_digest(self) -> str:
        # Sorted, compact, ASCII-only JSON: one byte string per namespace on
        # every platform and Python version (no hash seed, no float text).
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        record["seal"] = self.seal.scheme  # the scheme only: the secret is in no name
        text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:DIGEST_CHARS]

    def digest(self) -> str:
        """Short stable hex of the namespace (SHA-256 of its canonical encoding)."""
        return self._digest

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def page_bytes(self) -> int:
        """Exact payload size of one page of this namespace."""
        return self.num_layers * self.page_size * self.row_bytes


def check_page_hash(name: str, value: object) -> str:
    """SGLang's page hash: 64 lowercase hex characters."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not _is_hex(value, PAGE_HASH_CHARS):
        raise ValueError(
            f"{name} must be {PAGE_HASH_CHARS} lowercase hex characters "
            f"(SGLang's page hash), got {value!r}"
        )
    return value


def split_page_key(name: str, key: object) -> tuple[str, str, str]:
    """``(page_hash, namespace digest, parent)`` of a well-formed page key."""
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__}")
    match = _PAGE_KEY.fullmatch(key)  # one C-level match: this runs for every object read and written
    if match is None:
        raise ValueError(
            f"{name} must be '<{PAGE_HASH_CHARS} hex page hash>_<{DIGEST_CHARS} hex namespace digest>_"
            f"<{PARENT_CHARS} hex of the parent's page hash, or {ROOT_PARENT}>', got {key!r}"
        )
    return match.group(1), match.group(2), match.group(3)


def check_page_key(name: str, key: object, namespace: L3Namespace | None = None) -> str:
    """A well-formed page key; of ``namespace`` when one is given."""
    _, digest, _ = split_page_key(name, key)
    if namespace is not None and digest != namespace.digest():
        raise ValueError(
            f"{name} {key!r} is not a key of namespace {namespace.digest()} (it names {digest})"
        )
    return key  # type: ignore[return-value]


def _parent_text(parent: Optional[str]) -> str:
    if parent is None:
        return ROOT_PARENT
    check_page_hash("parent", parent)
    return parent[:PARENT_CHARS]


def page_key(page_hash: str, namespace: L3Namespace, parent: Optional[str] = None) -> str:
    """The L3 key of one page: its hash, its namespace digest and its
    parent's hash (None: the first page of a chain)."""
    check_page_hash("page_hash", page_hash)
    if not isinstance(namespace, L3Namespace):
        raise TypeError(f"namespace must be an L3Namespace, got {type(namespace).__name__}")
    return f"{page_hash}_{namespace.digest()}_{_parent_text(parent)}"


def page_keys(page_hashes: Sequence[str], namespace: L3Namespace, first_parent: Optional[str] = None) -> list[str]:
    """Keys of a chain's pages, in chain order (all checked before any is
    built). ``first_parent``: the page hash before the first one (None: the
    chain starts at the root)."""
    if isinstance(page_hashes, str) or not isinstance(page_hashes, Sequence):
        raise TypeError(f"page_hashes must be a list of str, got {type(page_hashes).__name__}")
    for i, value in enumerate(page_hashes):
        check_page_hash(f"page_hashes[{i}]", value)
    parents = [first_parent, *page_hashes[:-1]]
    return [page_key(h, namespace, p) for h, p in zip(page_hashes, parents)]
