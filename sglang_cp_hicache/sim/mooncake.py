"""Mooncake FAST'25 traces (kvcache-ai/Mooncake, ``FAST25-release/traces``)
as simulator requests.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

``hash_ids`` names the request's prompt in blocks of
:data:`MOONCAKE_BLOCK_TOKENS` (512) tokens; equal ids are equal prefix blocks
(an id is a hash of its block and everything before it), so two requests
share exactly the blocks up to their first differing id. The last block is
partial unless ``input_length`` is a multiple of 512.

Each id becomes one block of ``block_tokens`` token ids (default one KV
page, 64: the sharing structure at 1/8 of the real lengths; 512 replays the
real lengths): the same id always the same ids, whatever the line, the
file or the run (a pure function of the id), so an L3 directory written by
one replay is read by the next. The last block is cut to the request's
length at that scale: ``ceil(tail * block_tokens / 512)`` tokens for a
``tail``-token last block (at 512, exactly ``input_length``).

``timestamp`` (ms since the trace began) must not decrease from one line to
the next: lines are replayed in file order, one request at a time, as the
arrival order; the gaps between arrivals do not pace the replay (nothing in
the simulated cache depends on wall time but LRU order, which the order
already fixes). ``output_length`` is checked and not used: decode tokens
never enter a prefill cache.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_cp_hicache.sim.packed import TOKEN_TYPECODE

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "MAX_HASH_ID",
    "BlockTokens",
    "MooncakeLine",
    "is_mooncake",
    "parse_mooncake",
    "scaled_length",
]

#: Tokens per hash id in the trace release.
MOONCAKE_BLOCK_TOKENS = 512
#: Tokens per hash id in the replay unless told otherwise: one KV page.
DEFAULT_BLOCK_TOKENS = 64
#: Hash ids are non-negative and below 2**63 (JSON integers a C long holds).
MAX_HASH_ID = 2**63 - 1
_VOCAB = 32_000  # token ids in [1, _VOCAB), like the synthetic workload


def is_mooncake(obj: Any) -> bool:
    """Whether a parsed line is in the Mooncake format (has ``hash_ids``)."""
    return isinstance(obj, dict) and "hash_ids" in obj


def scaled_length(input_length: int, num_blocks: int, block_tokens: int) -> int:
    """The request's length with ``block_tokens`` tokens a block: whole
    blocks, then the last block's share of 512 at that scale (rounded up, at
    least one token)."""
    tail = input_length - MOONCAKE_BLOCK_TOKENS * (num_blocks - 1)
    return block_tokens * (num_blocks - 1) + -(-tail * block_tokens // MOONCAKE_BLOCK_TOKENS)


class BlockTokens:
    """Token ids of each hash id's block, made once per id and kept."""

    def __init__(self, block_tokens: int) -> None:
        if not 1 <= block_tokens <= MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [1, {MOONCAKE_BLOCK_TOKENS}], got {block_tokens}")
        self.block_tokens = block_tokens
        self._blocks: dict[int, array] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def block(self, hash_id: int) -> array:
        ids = self._blocks.get(hash_id)
        if ids is None:
            n = self.block_tokens
            seed = int.from_bytes(hashlib.sha256(f"mooncake-block:{hash_id}".encode()).digest()[:8], "little")
            words = array("I")  # unsigned 32-bit: 4 bytes on every platform torch runs on
            words.frombytes(random.Random(seed).getrandbits(32 * n).to_bytes(4 * n, "little"))
            ids = array(TOKEN_TYPECODE, [w % (_VOCAB - 1) + 1 for w in words])
            self._blocks[hash_id] = ids
        return ids


@dataclass
class MooncakeLine:
    """What a Mooncake line became: its token ids and arrival time."""

    tokens: array
    timestamp_ms: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_mooncake(
    obj: Any,
    fail: Callable[[str], Exception],
    blocks: BlockTokens,
    length_problem: Callable[[int], Optional[str]],
    last_timestamp: Optional[tuple[int, int]],
) -> MooncakeLine:
    """One Mooncake line's request; ``fail(message)`` makes the error naming
    the line, ``length_problem(n)`` says why ``n`` tokens cannot be replayed,
    ``last_timestamp`` is the previous line's (timestamp, line number)."""
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" not in obj:
        raise fail("not a Mooncake line (no 'hash_ids') in a trace whose first line is one: one format per file")
    for key in ("timestamp", "input_length"):
        if key not in obj:
            raise fail(f"a Mooncake line needs 'timestamp', 'input_length' and 'hash_ids'; '{key}' is missing")
    timestamp, input_length, hash_ids = obj["timestamp"], obj["input_length"], obj["hash_ids"]
    if not _is_int(timestamp) or timestamp < 0:
        raise fail(f"'timestamp' must be a non-negative integer (ms), got {timestamp!r:.80}")
    if last_timestamp is not None and timestamp < last_timestamp[0]:
        raise fail(f"'timestamp' {timestamp} is earlier than line {last_timestamp[1]}'s {last_timestamp[0]}: "
                   "lines are replayed in file order as the arrival order")
    if not _is_int(input_length) or input_length < 1:
        raise fail(f"'input_length' must be a positive integer, got {input_length!r:.80}")
    output_length = obj.get("output_length", 0)
    if not _is_int(output_length) or output_length < 0:
        raise fail(f"'output_length' must be a non-negative integer, got {output_length!r:.80}")
    if not isinstance(hash_ids, list) or not hash_ids:
        raise fail("'hash_ids' must be a non-empty list of integers")
    want = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != want:
        raise fail(f"'hash_ids' has {len(hash_ids)} ids, but input_length {input_length} makes {want} blocks of "
                   f"{MOONCAKE_BLOCK_TOKENS} tokens")
    for i, h in enumerate(hash_ids):
        if not _is_int(h) or not 0 <= h <= MAX_HASH_ID:
            raise fail(f"'hash_ids'[{i}] must be an integer in [0, 2**63), got {h!r:.80}")
    n = scaled_length(input_length, len(hash_ids), blocks.block_tokens)
    problem = length_problem(n)  # before a single token is generated
    if problem is not None:
        raise fail(problem)
    tokens = array(TOKEN_TYPECODE)
    for h in hash_ids:
        tokens.extend(blocks.block(h))
    del tokens[n:]
    return MooncakeLine(tokens, timestamp)
