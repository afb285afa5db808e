"""A :class:`~sglang_cp_hicache.l3.store.PageStore` on a Mooncake distributed
store (``mooncake.store.MooncakeDistributedStore``).

Each rank opens its own client: it mounts ``global_segment_size`` bytes of
its host memory into the store and moves objects through a
``local_buffer_size`` staging buffer (an object larger than the buffer cannot
be written). The store holds our envelopes whole, under our page keys: it
neither builds nor trusts them, and readers verify every object.

Mooncake answers a missing object with empty bytes and a batch with one
status for all its objects; both are mapped onto the per-key results of the
interface (an envelope is never empty, so empty means missing). Every object
of a batch passes through the client's staging buffer (``local_buffer_size``):
objects past it come back empty. So reads and writes go in batches that fit
it (the reader knows each object's size); an object larger than the buffer
cannot be moved at all. Nothing here raises on I/O: a failed read is a miss,
a failed write is False and logged.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from sglang_cp_hicache.l3.clear import ClearReport
from sglang_cp_hicache.l3.keys import PAGE_HASH_CHARS, PARENT_CHARS, ROOT_PARENT, check_page_key
from sglang_cp_hicache.l3.store import SizeMismatch, check_blobs, check_keys, check_sizes
from sglang_cp_hicache.sizes import parse_mooncake_size

__all__ = ["MooncakeConfig", "MooncakePageStore"]

logger = logging.getLogger(__name__)

Blob = Union[bytes, bytearray, memoryview]
_GIB = 1 << 30
_MIB = 1 << 20
#: Mooncake refuses to mount a smaller segment.
MIN_SEGMENT_BYTES = 16 * _MIB


def _text(name: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not empty_ok and not value.strip():
        raise ValueError(f"{name} must not be empty")
    return value.strip()


@dataclass(frozen=True)
class MooncakeConfig:
    """One rank's Mooncake client. Defaults are SGLang's Mooncake backend's."""

    master_server_address: str  # host:port of mooncake_master
    metadata_server: str = "P2PHANDSHAKE"  # or an http://host:port/metadata server
    local_hostname: str = "localhost"  # this rank's address as the other clients reach it
    protocol: str = "rdma"  # "tcp" where there is no RDMA
    device_name: str = ""  # RDMA device(s); empty: auto / none for tcp
    global_segment_size: int = 4 * _GIB  # host memory this rank lends the store
    local_buffer_size: int = 16 * _MIB  # staging buffer: the largest object and batch
    tenant_id: str = "default"  # the Mooncake tenant (another tenant's objects are out of reach)
    enable_ssd_offload: bool = False  # the client offloads objects to SSD
    ssd_offload_path: Optional[str] = None  # this rank's SSD offload directory (None: Mooncake's default)

    def __post_init__(self) -> None:
        master = _text("master_server_address", self.master_server_address)
        host, sep, port = master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"master_server_address must be host:port, got {self.master_server_address!r}")
        _text("metadata_server", self.metadata_server)
        _text("local_hostname", self.local_hostname)
        _text("protocol", self.protocol)
        _text("device_name", self.device_name, empty_ok=True)
        _text("tenant_id", self.tenant_id)
        if not isinstance(self.enable_ssd_offload, bool):
            raise TypeError(f"enable_ssd_offload must be a bool, got {self.enable_ssd_offload!r}")
        if self.ssd_offload_path is not None:
            _text("ssd_offload_path", self.ssd_offload_path)
        for name, minimum in (("global_segment_size", MIN_SEGMENT_BYTES), ("local_buffer_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int byte count (from_extra_config reads text), got {value!r}")
            parse_mooncake_size(name, value, minimum)

    @classmethod
    def from_extra_config(cls, extra: Union[None, str, Mapping[str, Any]]) -> "MooncakeConfig":
        """From ``--hicache-storage-backend-extra-config`` (a JSON object or a
        dict), reading the keys SGLang's Mooncake backend reads;
        ``local_buffer_size`` is this library's own. Keys of other backends
        are ignored; a client-only deployment (``client_server_address``
        without a master) is not supported."""
        if isinstance(extra, str):
            try:
                extra = json.loads(extra) if extra.strip() else {}
            except ValueError as exc:
                raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {exc}") from None
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise ValueError(f"hicache_storage_backend_extra_config must be a JSON object, got {type(extra).__name__}")
        if "master_server_address" not in extra:
            raise ValueError("master_server_address (host:port) is required in hicache_storage_backend_extra_config")
        known = {f: extra[f] for f in ("metadata_server", "local_hostname", "protocol", "device_name") if f in extra}
        for size in ("global_segment_size", "local_buffer_size"):
            if size in extra:
                known[size] = parse_mooncake_size(size, extra[size])  # the range is checked by the constructor
        return cls(master_server_address=extra["master_server_address"], **known)


def _check_blobs(blobs: object, count: int) -> list[bytes]:
    out = [bytes(view) for view in check_blobs(blobs, count)]
    for i, blob in enumerate(out):
        if not blob:
            raise ValueError(f"blobs[{i}] is empty (Mooncake reads an empty object as missing)")
    return out


def _open_client(config: MooncakeConfig) -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            "--hicache-storage-backend mooncake needs the mooncake package "
            "(pip install mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda "
            f"on a machine without CUDA): {exc}"
        ) from exc
    client = MooncakeDistributedStore()
    options: dict[str, Any] = {}  # passed only when set, as SGLang does (older clients lack them)
    if config.enable_ssd_offload:
        options["enable_ssd_offload"] = True
    if config.ssd_offload_path is not None:
        os.makedirs(config.ssd_offload_path, exist_ok=True)
        options["ssd_offload_path"] = config.ssd_offload_path
    if config.tenant_id != "default":
        options["tenant_id"] = config.tenant_id
    rc = client.setup(
        config.local_hostname, config.metadata_server, config.global_segment_size,
        config.local_buffer_size, config.protocol, config.device_name, config.master_server_address,
        **options,
    )
    if rc != 0:
        raise RuntimeError(
            f"Mooncake store setup failed (code {rc}): master {config.master_server_address}, "
            f"metadata {config.metadata_server}, protocol {config.protocol}"
        )
    return client


def fitting_batches(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, split so each batch's total is at most
    ``limit``; an item larger than ``limit`` goes alone (and fails alone)."""
    batches: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not batches or total + size > limit:
            batches.append([])
            total = 0
        batches[-1].append(i)
        total += size
    return batches


def _address(view: memoryview) -> int:
    """The address of a writable contiguous buffer (no copy)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MooncakePageStore:
    """Page objects in a Mooncake distributed store (one client per rank).

    A put replaces what is under the key (``upsert``): whether an object
    already there is sound and may be kept is the writer's decision.
    ``client``: an already set-up ``MooncakeDistributedStore`` (or a
    stand-in with its calls); otherwise one is opened from ``config`` now (a
    bad setup raises).

    Without copies where the client allows it: a reader's long-lived
    buffers (the L3 threads' staging buffers, :meth:`register_buffers`) are
    registered with the client once, and :meth:`read_into` fills them in
    place (``batch_get_into_multi_buffers``: header and page, one transfer);
    :meth:`write_from` sends the header and the page's own bytes as the
    parts of one object (``upsert_parts``), with no joined copy.
    """

    def __init__(self, config: MooncakeConfig, *, client: Optional[Any] = None) -> None:
        if not isinstance(config, MooncakeConfig):
            raise TypeError(f"config must be a MooncakeConfig, got {type(config).__name__}")
        self.config = config
        self._client = client if client is not None else _open_client(config)
        self._registered: set[tuple[int, int]] = set()  # (address, bytes) registered with the client
        self._register_lock = threading.Lock()

    def close(self) -> None:
        """Unmount this rank's segment (its objects leave the store)."""
        if self._client is not None:
            client, self._client = self._client, None
            client.close()

    def _live(self) -> Any:
        if self._client is None:
            raise RuntimeError("this MooncakePageStore is closed")
        return self._client

    def exists(self, keys: Sequence[str]) -> list[bool]:
        checked = check_keys(keys)
        client = self._live()
        if not checked:
            return []
        try:
            flags = list(client.batch_is_exist(checked))
        except Exception as exc:  # an unreachable store answers "absent"
            logger.warning("L3 mooncake store: exists failed for %d keys: %s", len(checked), exc)
            return [False] * len(checked)
        return [flag == 1 for flag in flags] if len(flags) == len(checked) else [False] * len(checked)

    def get(self, keys: Sequence[str], sizes: Optional[Sequence[int]] = None) -> list[bytes | SizeMismatch | None]:
        checked = check_keys(keys)
        expected = check_sizes(sizes, len(checked))
        self._live()  # a closed store raises here, before any batch
        if not checked:  # Mooncake answers an empty batch with one empty object
            return []
        limit = self.config.local_buffer_size
        # Without sizes nothing tells how objects fill the buffer: one at a time.
        batches = fitting_batches([s if s is not None else limit for s in expected], limit)
        out: list[bytes | SizeMismatch | None] = [None] * len(checked)
        for batch in batches:
            if expected[batch[0]] is not None and expected[batch[0]] > limit:
                logger.warning("L3 mooncake store: an object of %d bytes cannot pass the %d-byte staging "
                               "buffer (local_buffer_size)", expected[batch[0]], limit)
                continue
            for i, blob in zip(batch, self._get_batch([checked[i] for i in batch])):
                if blob is not None and expected[i] is not None and len(blob) != expected[i]:
                    blob = SizeMismatch(len(blob))
                out[i] = blob
        return out

    def register_buffers(self, views: Sequence[memoryview]) -> bool:
        """Register long-lived buffers (they must outlive this store) for
        :meth:`read_into` in place; False if the client refuses (reads then copy)."""
        with self._register_lock:
            for view in views:
                region = (_address(view), len(view))
                if region in self._registered:
                    continue
                try:
                    if self._live().register_buffer(*region) != 0:
                        return False
                except Exception as exc:  # a client without registration: the copying path
                    logger.warning("L3 mooncake store: cannot register a %d-byte buffer: %s", len(view), exc)
                    return False
                self._registered.add(region)
        return True

    def unregister_buffers(self, views: Sequence[memoryview]) -> None:
        """Release the registration of buffers about to be freed (no read
        into them may be in flight); buffers never registered are ignored."""
        with self._register_lock:
            for view in views:
                region = (_address(view), len(view))
                if region not in self._registered:
                    continue
                self._registered.discard(region)  # never read into again, whatever the client says
                try:
                    if self._client is not None and self._client.unregister_buffer(region[0]) != 0:
                        logger.warning("L3 mooncake store: the client kept a %d-byte buffer registered", region[1])
                except Exception as exc:
                    logger.warning("L3 mooncake store: cannot unregister a %d-byte buffer: %s", region[1], exc)

    def read_into(self, key: str, size: int, views: Sequence[memoryview]) -> int | SizeMismatch | None:
        """Read ``key``'s object (``size`` bytes) into ``views``: in place when
        every view is registered (:meth:`register_buffers`), else through the
        client's staging buffer and a copy. None where there is no object."""
        check_page_key("key", key)
        client = self._live()
        regions = [(_address(v), len(v)) for v in views]
        if sum(n for _, n in regions) != size:
            raise ValueError(f"views must hold size={size} bytes, got {sum(n for _, n in regions)}")
        if not all(r in self._registered for r in regions):
            return self._read_copying(key, size, views)
        try:
            got = client.batch_get_into_multi_buffers([key], [[a for a, _ in regions]], [[n for _, n in regions]])[0]
        except Exception as exc:  # a failed read is a miss, never a crash
            logger.warning("L3 mooncake store: get_into failed for %s: %s", key, exc)
            return None
        if got == size:
            return got
        return self._why_not(key, size)

    def _read_copying(self, key: str, size: int, views: Sequence[memoryview]) -> int | SizeMismatch | None:
        blob = self.get([key], [size])[0]
        if blob is None or isinstance(blob, SizeMismatch):
            return blob
        data, offset = memoryview(blob), 0
        for view in views:
            view[:] = data[offset:offset + len(view)]
            offset += len(view)
        return size

    def _why_not(self, key: str, size: int) -> SizeMismatch | None:
        """A failed in-place read: no object, or one of another size."""
        try:
            if not self.exists([key])[0]:
                return None
            stored = int(self._client.get_size(key))
        except Exception:
            return None
        return SizeMismatch(stored) if stored >= 0 and stored != size else None

    def write_from(self, key: str, views: Sequence[memoryview]) -> bool:
        """Store the concatenation of ``views`` under ``key`` as the parts of
        one object (no joined copy), replacing what is there."""
        check_page_key("key", key)
        client = self._live()
        if sum(len(v) for v in views) > self.config.local_buffer_size:
            logger.warning("L3 mooncake store: an object of %d bytes cannot pass the %d-byte staging buffer",
                           sum(len(v) for v in views), self.config.local_buffer_size)
            return False
        try:
            return client.upsert_parts(key, *views) == 0
        except Exception as exc:
            logger.warning("L3 mooncake store: write of %s raised: %s", key, exc)
            return False

    def _get_batch(self, keys: list[str]) -> list[bytes | None]:
        try:
            blobs = list(self._client.get_batch(keys))
        except Exception as exc:  # a failed read is a miss, never a crash
            logger.warning("L3 mooncake store: get failed for %d keys: %s", len(keys), exc)
            return [None] * len(keys)
        if len(blobs) != len(keys):
            logger.warning("L3 mooncake store: get returned %d objects for %d keys", len(blobs), len(keys))
            return [None] * len(keys)
        return [bytes(blob) if blob else None for blob in blobs]

    def put(self, keys: Sequence[str], blobs: Sequence[Blob]) -> list[bool]:
        checked = check_keys(keys)
        data = _check_blobs(blobs, len(checked))
        self._live()
        results = [False] * len(checked)
        for batch in fitting_batches([len(d) for d in data], self.config.local_buffer_size):
            for i, ok in zip(batch, self._upsert(batch, checked, data)):
                results[i] = ok
        for key, ok in zip(checked, results):
            if not ok:
                logger.warning("L3 mooncake store: cannot write %s", key)
        return results

    def _upsert(self, batch: list[int], keys: list[str], data: list[bytes]) -> list[bool]:
        """One status per object: the batch's, or on its failure each
        object's own (Mooncake reports one code for a whole batch)."""
        try:
            if self._client.upsert_batch([keys[i] for i in batch], [data[i] for i in batch]) == 0:
                return [True] * len(batch)
        except Exception as exc:
            logger.warning("L3 mooncake store: batch write of %d objects failed: %s", len(batch), exc)
        out = []
        for i in batch:
            try:
                rc = self._client.upsert(keys[i], data[i])
            except Exception as exc:
                logger.warning("L3 mooncake store: write of %s raised: %s", keys[i], exc)
                rc = -1
            out.append(rc == 0)
        return out

    def clear_namespaces(self, digests: Sequence[str]) -> ClearReport:
        """Remove every object of the namespaces ``digests`` from the whole
        store (every client's segment), by key pattern
        (``remove_by_regex``): objects of other namespaces -- other
        deployments, other models, SGLang's own keys -- stay, which
        ``remove_all`` (SGLang's own clear) would take too. Objects under
        Mooncake's read lease (any object looked up or read in the last
        ``--default_kv_lease_ttl``, 10 s by default) go too (``force``): the
        lease keeps unverified readers from reading reused memory, and every
        reader of these keys verifies each object, so a read racing the clear
        is refused -- a miss, never a wrong page."""
        if isinstance(digests, str) or not digests or not all(
                isinstance(d, str) and re.fullmatch(r"[0-9a-f]+", d) for d in digests):
            raise ValueError(f"digests must be namespace digests (lowercase hex), got {digests!r}")
        # page keys: <page hash>_<namespace digest>_<parent link>
        pattern = ("^[0-9a-f]{%d}_(?:" % PAGE_HASH_CHARS + "|".join(sorted(digests))
                   + ")_(?:%s|[0-9a-f]{%d})$" % (ROOT_PARENT, PARENT_CHARS))
        try:
            removed = int(self._live().remove_by_regex(pattern, True))
        except Exception as exc:  # an admin call answers, it never raises on the store
            return ClearReport(0, 1, f"mooncake remove_by_regex failed: {exc}")
        if removed < 0:
            return ClearReport(0, 1, f"mooncake remove_by_regex returned error code {removed}")
        return ClearReport(removed)
