"""A store's optional capabilities are declared Protocols, found once when
the tier opens the store: a store with none is served through its three
calls; bad stores are refused naming the argument."""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.l3.capabilities import StoreCapabilities
from sglang_cp_hicache.l3.pages import PutOutcome, read_verified, store_verified
from sglang_cp_hicache.l3.store import FilePageStore
from tests.l3.common import hash_chain, namespace, payload, scratch

NS = namespace()
KEY = f"{hash_chain(1)[0]}_{NS.digest()}_root"


class PlainStore:
    """Only the three calls of PageStore, in memory."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[str] = []

    def exists(self, keys):
        self.calls.append("exists")
        return [k in self.objects for k in keys]

    def get(self, keys, sizes=None):
        self.calls.append("get")
        return [self.objects.get(k) for k in keys]

    def put(self, keys, blobs):
        self.calls.append("put")
        self.objects.update((k, bytes(b)) for k, b in zip(keys, blobs))
        return [True] * len(keys)


def test_the_file_store_declares_its_copy_free_calls_and_mooncakes_registration_is_absent(tmp_path):
    caps = StoreCapabilities.of(FilePageStore(tmp_path))
    assert caps.names() == ["read_into", "write_from", "open_object"]
    assert StoreCapabilities.of(PlainStore()).names() == []


def test_a_store_with_only_the_three_calls_writes_and_reads_bit_exact_through_them():
    store = PlainStore()
    caps = StoreCapabilities.of(store)
    page = payload(NS, 7)
    assert store_verified(caps, NS, KEY, page, scratch(NS)) is PutOutcome.WRITTEN
    assert store.calls == ["exists", "put"]
    head, got = scratch(NS)
    assert read_verified(caps, NS, KEY, head, got) is None
    assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.uint8), page)
    assert store_verified(caps, NS, KEY, page, scratch(NS)) is PutOutcome.KEPT  # read, found sound, kept


def test_capabilities_are_found_once_not_at_every_call():
    store = PlainStore()
    caps = StoreCapabilities.of(store)
    store.write_from = lambda key, views: pytest.fail("a capability added later was used")
    assert store_verified(caps, NS, KEY, payload(NS, 1), scratch(NS)) is PutOutcome.WRITTEN
    assert store.calls[-1] == "put"


@pytest.mark.parametrize("bad", [object(), "dir", None])
def test_what_is_no_store_is_refused_naming_the_argument(bad):
    with pytest.raises(TypeError, match="store must be a PageStore"):
        StoreCapabilities.of(bad)
