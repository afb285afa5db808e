"""L3 (HiCache storage tier) for CP-sharded KV, torch and stdlib only.

* ``keys`` -- topology-free page keys: SGLang's page hash + a digest of
  what makes the page's bytes (:class:`L3Namespace`); no CP rank or size;
* ``envelope`` -- the stored object: header (format, namespace, key,
  length, tag) + payload; ``unpack`` verifies or says why not;
* ``auth`` -- the tag: XXH3-64, or keyed BLAKE3 with a deployment secret;
* ``plan`` -- which pages of a chain each rank writes and reads (its own);
* ``consensus`` -- each rank's usable prefix, and the agreed one (the MIN);
* ``store`` -- the :class:`PageStore` interface and a file store;
* ``pages`` -- one rank's store/fetch of its own pages of a chain;
* ``host_tier`` -- one rank's L3 tier on a pair of host pools (KV and DSA
  indexer), what both SGLang adapters share;
* ``staging`` -- staging buffers lent one page at a time (bounded).
"""

from sglang_cp_hicache.l3.consensus import local_usable_pages
from sglang_cp_hicache.l3.envelope import Rejection, pack, unpack
from sglang_cp_hicache.l3.host_tier import HostL3Tier, L3Counters, L3Snapshot
from sglang_cp_hicache.l3.keys import L3Namespace, page_key, page_keys
from sglang_cp_hicache.l3.plan import (
    L3ReadPlan,
    L3WritePlan,
    interleaved_owners,
    read_plan,
    write_plan,
)
from sglang_cp_hicache.l3.store import FilePageStore, PageStore

__all__ = [
    "FilePageStore",
    "HostL3Tier",
    "L3Counters",
    "L3Namespace",
    "L3ReadPlan",
    "L3Snapshot",
    "L3WritePlan",
    "PageStore",
    "Rejection",
    "interleaved_owners",
    "local_usable_pages",
    "pack",
    "page_key",
    "page_keys",
    "read_plan",
    "unpack",
    "write_plan",
]
