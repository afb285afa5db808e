"""What a page store can do beyond the three calls of :class:`PageStore`,
declared once and found once, when the tier opens the store.

Each optional capability is a Protocol. A store that has one serves the
copy-free path it names; any other store is served through the three
calls (``get`` / ``put``), copying once. Reading the capabilities at every
call would let a store change shape under a running tier, and would hide
from every tool which calls the library makes on a store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

from sglang_cp_hicache.l3.store import OpenObject, PageStore, SizeMismatch

__all__ = ["OpensObjects", "ReadsInto", "RegistersBuffers", "StoreCapabilities", "WritesFrom"]


@runtime_checkable
class ReadsInto(Protocol):
    """Reads an object straight into the caller's buffers (one scatter read)."""

    def read_into(self, key: str, size: int, views: Sequence[memoryview]) -> int | SizeMismatch | None:
        """Fill ``views`` (their lengths add up to ``size``) with ``key``'s
        object; the bytes read, None where there is no object, or
        :class:`SizeMismatch` (nothing read) for an object of another size."""
        ...


@runtime_checkable
class WritesFrom(Protocol):
    """Writes an object from several buffers (one gather write, no joined copy)."""

    def write_from(self, key: str, views: Sequence[memoryview]) -> bool:
        """Store the concatenation of ``views`` under ``key``; False where it failed."""
        ...


@runtime_checkable
class OpensObjects(Protocol):
    """Opens an object to read it in parts, from the page cache alone if asked
    (a file store): what lets a read go straight into host rows."""

    def open_object(self, key: str, size: int) -> OpenObject | SizeMismatch | None:
        ...


@runtime_checkable
class RegistersBuffers(Protocol):
    """Reads in place only into buffers registered with it (Mooncake)."""

    def register_buffers(self, views: Sequence[memoryview]) -> bool:
        ...

    def unregister_buffers(self, views: Sequence[memoryview]) -> None:
        ...


@dataclass(frozen=True)
class StoreCapabilities:
    """A store with its optional capabilities found (each None: absent)."""

    store: PageStore
    reads_into: Optional[ReadsInto] = None
    writes_from: Optional[WritesFrom] = None
    opens_objects: Optional[OpensObjects] = None
    registers_buffers: Optional[RegistersBuffers] = None

    @classmethod
    def of(cls, store: object) -> "StoreCapabilities":
        """``store``'s capabilities; TypeError if it is no :class:`PageStore`."""
        if not isinstance(store, PageStore):
            raise TypeError(f"store must be a PageStore (exists, get, put), got {type(store).__name__}")
        return cls(
            store,
            store if isinstance(store, ReadsInto) else None,
            store if isinstance(store, WritesFrom) else None,
            store if isinstance(store, OpensObjects) else None,
            store if isinstance(store, RegistersBuffers) else None,
        )

    def names(self) -> list[str]:
        """The capabilities present, by method name (for logs and tests)."""
        found = [("read_into", self.reads_into), ("write_from", self.writes_from),
                 ("open_object", self.opens_objects), ("register_buffers", self.registers_buffers)]
        return [name for name, value in found if value is not None]
