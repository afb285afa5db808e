"""Request streams for the simulator: synthetic multi-turn chat or a JSONL trace.

Every rank replays the same list of :class:`SimRequest` in the same order
(the SGLang contract: identical scheduler decisions on every CP rank).

Synthetic chat (:func:`synthetic_chat`): a few shared system prompts
(``groups``); each request either starts a conversation (system prompt + user
turn), extends one (the whole history + assistant reply + next user turn), or
forks one at an earlier turn (same history up to there, a different user turn).
Lengths are in tokens and deliberately not page-aligned.

Trace (:func:`load_trace`): one JSON object per line, in one of two formats
detected from the file's first line. A Mooncake FAST'25 trace (lines with
``hash_ids``: :mod:`.mooncake`), or this simulator's own: either
``{"tokens": [int, ...]}`` or
``{"prompt_len": int, "prefix_group": str | int, "shared_len": int}``
(``shared_len`` optional, default ``prompt_len // 2``): the first
``shared_len`` tokens come from the group's deterministic token stream (so two
requests of one group share ``min`` of their ``shared_len``), the rest are
unique to the line. Other keys are ignored; blank lines are skipped.

Limits (a trace is untrusted input; each is checked before anything is
generated, and a violation names the file and the line): a line is at most
:data:`MAX_TRACE_LINE_BYTES` (read in bounded chunks, so ``/dev/zero`` fails
at once), UTF-8, JSON nested at most as deep as Python's parser allows, a
request at most ``max_tokens`` (the simulated pool's logical capacity) and
:data:`MAX_REQUEST_TOKENS` tokens, the whole trace at most
:data:`MAX_TRACE_TOKENS`.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any, BinaryIO, Iterator, Optional

from sglang_cp_hicache.sim.mooncake import (
    DEFAULT_BLOCK_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    BlockTokens,
    is_mooncake,
    parse_mooncake,
)
from sglang_cp_hicache.sim.packed import PackedRequests

__all__ = [
    "MAX_REQUEST_TOKENS",
    "MAX_TRACE_LINE_BYTES",
    "MAX_TRACE_TOKENS",
    "ChatShape",
    "SimRequest",
    "Trace",
    "TraceError",
    "TraceInfo",
    "VOCAB_SIZE",
    "load_trace",
    "pack_requests",
    "synthetic_chat",
]

VOCAB_SIZE = 32_000
_MAX_TOKEN_ID = 2**31 - 1
#: Longest trace line, newline excluded: a "tokens" list of 16 MiB holds about
#: two million ids, more than any simulated pool can hold.
MAX_TRACE_LINE_BYTES = 16 * 1024 * 1024
#: Longest request whatever the pool size (2**20 tokens = 16,384 pages of 64;
#: the simulator's pools are a few hundred pages).
MAX_REQUEST_TOKENS = 1 << 20
#: Tokens in the whole trace. Every rank holds its own copy, packed
#: (:class:`.packed.PackedRequests`): 4 bytes a token + 8 a request, plus
#: array's growth slack of a sixteenth -- at most 13 bytes a token (one-token
#: lines), 416 MiB per rank at 2**25, a little over 4 for long requests
#: (the Mooncake conversation trace, 18M tokens at 64 a hash id: ~73 MB a
#: rank); the launcher 8 more a request (line numbers). Use --requests to
#: replay the first lines of a longer one.
MAX_TRACE_TOKENS = 1 << 25


@dataclass(frozen=True)
class SimRequest:
    tokens: tuple[int, ...]
    label: str = ""  # "new:g1", "extend", "fork", "trace:12" ...

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class TraceInfo:
    """What a trace file was: its format and, for a Mooncake trace, the
    block scale and the arrival times of the lines replayed."""

    format: str = "tokens"  # "tokens" (tokens / prompt_len lines) or "mooncake"
    block_tokens: Optional[int] = None  # Mooncake: tokens per hash id
    first_timestamp_ms: Optional[int] = None
    last_timestamp_ms: Optional[int] = None
    distinct_blocks: int = 0  # Mooncake: hash ids in the lines replayed

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"trace_format": self.format}
        if self.format == "mooncake":
            out.update(trace_block_tokens=self.block_tokens, trace_distinct_blocks=self.distinct_blocks,
                       trace_timestamps_ms=[self.first_timestamp_ms, self.last_timestamp_ms])
        return out


class Trace(Sequence[SimRequest]):
    """A parsed trace: every request's ids packed (:attr:`packed`, what the
    ranks get), the line each came from and what the file was (:attr:`info`).
    Indexing and iteration build a :class:`SimRequest` per request on demand."""

    def __init__(self, packed: PackedRequests, line_numbers: array, info: Optional[TraceInfo] = None) -> None:
        self.packed = packed
        self.line_numbers = line_numbers
        self.info = info if info is not None else TraceInfo()

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return SimRequest(tuple(self.packed[index]), f"trace:{self.line_numbers[index]}")

    def __iter__(self) -> Iterator[SimRequest]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Trace):
            return self.packed == other.packed and self.line_numbers == other.line_numbers
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Trace({len(self)} requests, {self.packed.total_tokens} tokens)"


def pack_requests(requests: Sequence[SimRequest]) -> PackedRequests:
    """The ids the ranks replay: a trace's packed form, or ``requests`` packed."""
    if isinstance(requests, Trace):
        return requests.packed
    return PackedRequests.from_token_lists(r.tokens for r in requests)


class TraceError(ValueError):
    """A malformed trace line; ``str()`` names the file and the line."""

    def __init__(self, path: str, line_no: Optional[int], message: str) -> None:
        where = f"{path}:{line_no}" if line_no is not None else path
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line_no = line_no
        self.message = message


# ---------------------------------------------------------------------------
# Synthetic multi-turn chat
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatShape:
    """Token-length ranges (inclusive) and choice weights of the chat workload."""

    groups: int = 3
    system_tokens: tuple[int, int] = (100, 260)
    user_tokens: tuple[int, int] = (20, 160)
    reply_tokens: tuple[int, int] = (40, 260)
    p_new: float = 0.25
    p_fork: float = 0.2  # the rest extends a conversation
    recent: int = 12  # extend/fork among the most recent conversations, with a heavy tail


@dataclass
class _Conversation:
    group: int
    turns: list[tuple[int, ...]] = field(default_factory=list)  # cumulative histories

    @property
    def history(self) -> tuple[int, ...]:
        return self.turns[-1]


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def synthetic_chat(
    num_requests: int,
    *,
    seed: int,
    max_tokens: int,
    shape: ChatShape = ChatShape(),
) -> list[SimRequest]:
    """``num_requests`` chat requests, each at most ``max_tokens`` long."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    lo_first = shape.system_tokens[1] + shape.user_tokens[1]
    if max_tokens < lo_first:
        raise ValueError(f"max_tokens={max_tokens} cannot hold a first turn ({lo_first} tokens)")
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(*shape.system_tokens)) for _ in range(shape.groups)]
    convs: list[_Conversation] = []
    out: list[SimRequest] = []

    def start() -> SimRequest:
        group = rng.randrange(shape.groups)
        conv = _Conversation(group, [systems[group] + _tokens(rng, rng.randint(*shape.user_tokens))])
        convs.append(conv)
        return SimRequest(conv.history, f"new:g{group}")

    def pick() -> _Conversation:
        # mostly recent conversations, sometimes an old one (-> host hits)
        if rng.random() < 0.7:
            return convs[-1 - rng.randrange(min(shape.recent, len(convs)))]
        return convs[rng.randrange(len(convs))]

    while len(out) < num_requests:
        roll = rng.random()
        if not convs or roll < shape.p_new:
            out.append(start())
            continue
        conv = pick()
        if roll < shape.p_new + shape.p_fork and len(conv.turns) > 1:
            turn = rng.randrange(len(conv.turns) - 1)
            base = conv.turns[turn]
            fork = _Conversation(conv.group, conv.turns[: turn + 1])
            tokens = base + _tokens(rng, rng.randint(*shape.user_tokens))
            if len(tokens) > max_tokens:
                out.append(start())
                continue
            fork.turns.append(tokens)
            convs.append(fork)
            out.append(SimRequest(tokens, "fork"))
            continue
        tokens = (
            conv.history
            + _tokens(rng, rng.randint(*shape.reply_tokens))
            + _tokens(rng, rng.randint(*shape.user_tokens))
        )
        if len(tokens) > max_tokens:
            out.append(start())  # the conversation is full: a new one instead
            continue
        conv.turns.append(tokens)
        out.append(SimRequest(tokens, "extend"))
    return out


# ---------------------------------------------------------------------------
# JSONL traces
# ---------------------------------------------------------------------------


def _short(value: Any, limit: int = 80) -> str:
    """repr() for an error message, cut short (a value may be megabytes long)."""
    text = reprlib.repr(value) if not isinstance(value, int) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _group_stream(group: str, n: int) -> tuple[int, ...]:
    digest = hashlib.sha256(f"prefix_group:{group}".encode()).digest()
    return _tokens(random.Random(int.from_bytes(digest[:8], "little")), n)


def _length_problem(n: int, max_tokens: Optional[int], budget: int) -> Optional[str]:
    """Why a request of ``n`` tokens cannot be replayed (None if it can)."""
    if max_tokens is not None and n > max_tokens:
        return (f"request has {n} tokens but the simulated device holds at most {max_tokens} "
                f"(raise --device-pages)")
    if n > MAX_REQUEST_TOKENS:
        return f"request has {n} tokens; the simulator replays at most {MAX_REQUEST_TOKENS} per request"
    if n > budget:
        return (f"the trace exceeds {MAX_TRACE_TOKENS} tokens in total at this line "
                f"(replay fewer lines with --requests)")
    return None


def _parse_line(
    obj: Any, path: str, line_no: int, seed: int, max_tokens: Optional[int], budget: int
) -> Sequence[int]:
    """One request's token ids; ``budget``: tokens the trace may still add."""
    def fail(message: str) -> TraceError:
        return TraceError(path, line_no, message)

    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not tokens:
            raise fail("'tokens' must be a non-empty list of integers")
        problem = _length_problem(len(tokens), max_tokens, budget)
        if problem is not None:
            raise fail(problem)
        for i, t in enumerate(tokens):
            if not _is_int(t) or not 0 <= t <= _MAX_TOKEN_ID:
                raise fail(f"'tokens'[{i}] must be an integer in [0, {_MAX_TOKEN_ID}], got {_short(t)}")
        return tokens
    if "prompt_len" not in obj:
        if "hash_ids" in obj:
            raise fail("a Mooncake line ('hash_ids') in a trace whose first line has 'tokens' or 'prompt_len': "
                       "one format per file")
        raise fail("expected a 'tokens' list or a 'prompt_len' (with 'prefix_group')")
    prompt_len = obj["prompt_len"]
    if not _is_int(prompt_len) or prompt_len < 1:
        raise fail(f"'prompt_len' must be a positive integer, got {_short(prompt_len)}")
    problem = _length_problem(prompt_len, max_tokens, budget)  # before a single token is generated
    if problem is not None:
        raise fail(problem)
    if "prefix_group" not in obj:
        raise fail("'prompt_len' needs a 'prefix_group' (string or integer)")
    group = obj["prefix_group"]
    if isinstance(group, bool) or not isinstance(group, (str, int)):
        raise fail(f"'prefix_group' must be a string or an integer, got {_short(group)}")
    shared = obj.get("shared_len", prompt_len // 2)
    if not _is_int(shared) or not 0 <= shared <= prompt_len:
        raise fail(f"'shared_len' must be an integer in [0, prompt_len={prompt_len}], got {_short(shared)}")
    own = random.Random(seed * 1_000_003 + line_no)
    return _group_stream(str(group), shared) + _tokens(own, prompt_len - shared)


def _read_line(handle: BinaryIO, path: str, line_no: int) -> Optional[str]:
    """The next line as text (None at the end), read in one bounded chunk."""
    raw = handle.readline(MAX_TRACE_LINE_BYTES + 1)
    if not raw:
        return None
    if len(raw) > MAX_TRACE_LINE_BYTES and not (len(raw) == MAX_TRACE_LINE_BYTES + 1 and raw.endswith(b"\n")):
        raise TraceError(path, line_no, f"line {line_no} longer than {MAX_TRACE_LINE_BYTES} bytes (16 MiB): "
                                        "one JSON object per line")
    try:
        # a byte-order mark may open the file (some editors write one)
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(path, line_no, f"not UTF-8: byte {raw[exc.start:exc.start + 1]!r} at column "
                                        f"{exc.start + 1}") from None


def _decode_json(text: str, path: str, line_no: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(path, line_no, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TraceError(path, line_no, "invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal over Python's 4300-digit limit
        reason = str(exc).split(";")[0]
        raise TraceError(path, line_no, f"invalid JSON ({reason})") from None


class _MooncakeReader:
    """Turns a Mooncake file's lines into requests (:mod:`.mooncake`),
    keeping its blocks and arrival order."""

    def __init__(self, info: TraceInfo, block_tokens: int) -> None:
        self.blocks = BlockTokens(block_tokens)
        self.info = info
        info.format, info.block_tokens = "mooncake", block_tokens
        self._last: Optional[tuple[int, int]] = None  # (timestamp, line) of the previous request

    def parse(self, obj: Any, path: str, line_no: int, max_tokens: Optional[int], budget: int) -> Sequence[int]:
        line = parse_mooncake(
            obj, lambda message: TraceError(path, line_no, message), self.blocks,
            lambda n: _length_problem(n, max_tokens, budget), self._last,
        )
        self._last = (line.timestamp_ms, line_no)
        if self.info.first_timestamp_ms is None:
            self.info.first_timestamp_ms = line.timestamp_ms
        self.info.last_timestamp_ms = line.timestamp_ms
        self.info.distinct_blocks = len(self.blocks)
        return line.tokens


def load_trace(
    path: str | Path,
    *,
    seed: int,
    max_tokens: Optional[int] = None,
    limit: Optional[int] = None,
    block_tokens: Optional[int] = None,
) -> Trace:
    """Parse a JSONL trace; raise :class:`TraceError` naming the first bad line.

    The format is the first line's: Mooncake (``hash_ids``) or
    ``tokens`` / ``prompt_len``; every line must be in it.
    ``max_tokens``: longest request the simulated device can hold (requests
    are capped at :data:`MAX_REQUEST_TOKENS` regardless).
    ``limit``: keep only the first ``limit`` requests (later lines are not read).
    ``block_tokens``: a Mooncake trace's tokens per hash id (default
    :data:`.mooncake.DEFAULT_BLOCK_TOKENS`); refused for the other format.
    The requests are packed as they are parsed (see :data:`MAX_TRACE_TOKENS`).
    """
    path = str(path)
    out = Trace(PackedRequests(), array("q"))
    mooncake: Optional[_MooncakeReader] = None
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise TraceError(path, None, f"cannot read the trace: {exc.strerror or exc}") from None
    with handle:
        line_no = 0
        try:
            while limit is None or len(out) < limit:
                line_no += 1
                line = _read_line(handle, path, line_no)
                if line is None:
                    break
                if not line.strip():
                    continue
                obj = _decode_json(line, path, line_no)
                if not out and mooncake is None:  # the first request names the file's format
                    mooncake = _first_line_format(obj, path, line_no, block_tokens, out.info)
                budget = MAX_TRACE_TOKENS - out.packed.total_tokens
                if mooncake is not None:
                    out.packed.append(mooncake.parse(obj, path, line_no, max_tokens, budget))
                else:
                    out.packed.append(_parse_line(obj, path, line_no, seed, max_tokens, budget))
                out.line_numbers.append(line_no)
        except OSError as exc:
            raise TraceError(path, None, f"cannot read the trace: {exc.strerror or exc}") from None
    if not out:
        raise TraceError(path, None, "the trace holds no requests")
    return out


def _first_line_format(
    obj: Any, path: str, line_no: int, block_tokens: Optional[int], info: TraceInfo
) -> Optional[_MooncakeReader]:
    """A reader for a Mooncake file (None for the tokens / prompt_len format)."""
    if is_mooncake(obj):
        scale = DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens
        if not 1 <= scale <= MOONCAKE_BLOCK_TOKENS:
            raise TraceError(path, None, f"--trace-block-tokens must be in [1, {MOONCAKE_BLOCK_TOKENS}], got {scale}")
        return _MooncakeReader(info, scale)
    if block_tokens is not None:
        raise TraceError(path, line_no, "--trace-block-tokens applies to a Mooncake trace (lines with 'hash_ids'); "
                                        "this one is in the 'tokens' / 'prompt_len' format")
    return None
