"""Many requests' token ids in two flat arrays, the form the launcher hands
every rank process.

A tuple of tuples of Python ints costs about 36 bytes a token (an 8-byte
pointer and a 28-byte int object per id above 256), and over 100 a token for
one-token requests (a tuple per request); pickled to each rank, every rank
rebuilds all of it. :class:`PackedRequests` holds the ids as one ``int32``
array (4 bytes a token: ids are at most ``2**31 - 1``) and the request
boundaries as one ``int64`` array (8 bytes a request); it pickles to the raw
bytes of both arrays, so each rank holds the same 4 bytes a token plus 8 a
request.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator, Sequence

__all__ = ["TOKEN_TYPECODE", "PackedRequests"]

#: int32 token ids. ``"i"`` is a C int, 4 bytes on every platform torch runs on.
TOKEN_TYPECODE = "i"
_OFFSET_TYPECODE = "q"  # int64: request boundaries in the flat token array
if array(TOKEN_TYPECODE).itemsize != 4:  # pragma: no cover - exotic C ABI
    raise ImportError(f"array typecode {TOKEN_TYPECODE!r} is not 4 bytes on this platform")


class PackedRequests:
    """Requests' token ids, read back one request at a time.

    ``packed[i]`` is request ``i``'s ids as an ``array('i')`` (a copy of its
    slice); iteration yields them in order. Build with :meth:`append` or
    :meth:`from_token_lists`.
    """

    __slots__ = ("tokens", "offsets")

    def __init__(self) -> None:
        self.tokens = array(TOKEN_TYPECODE)
        self.offsets = array(_OFFSET_TYPECODE, [0])

    @classmethod
    def from_token_lists(cls, token_lists: Iterable[Sequence[int]]) -> "PackedRequests":
        packed = cls()
        for tokens in token_lists:
            packed.append(tokens)
        return packed

    def append(self, tokens: Iterable[int]) -> None:
        """Add one request (ids in ``[0, 2**31)``; OverflowError otherwise, nothing added)."""
        start = len(self.tokens)
        try:
            self.tokens.extend(tokens)
        except (OverflowError, TypeError):
            del self.tokens[start:]
            raise
        self.offsets.append(len(self.tokens))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> array:
        if not -len(self) <= index < len(self):
            raise IndexError(f"request {index} of {len(self)}")
        index %= len(self)
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def __iter__(self) -> Iterator[array]:
        for i in range(len(self)):
            yield self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def request_len(self, index: int) -> int:
        return self.offsets[index + 1] - self.offsets[index]

    @property
    def total_tokens(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        """Bytes of the two arrays' payload (what a pickle carries)."""
        return len(self.tokens) * self.tokens.itemsize + len(self.offsets) * self.offsets.itemsize

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedRequests):
            return NotImplemented
        return self.tokens == other.tokens and self.offsets == other.offsets

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __getstate__(self) -> tuple[array, array]:
        return self.tokens, self.offsets

    def __setstate__(self, state: tuple[array, array]) -> None:
        self.tokens, self.offsets = state

    def __repr__(self) -> str:
        return f"PackedRequests({len(self)} requests, {self.total_tokens} tokens)"
