"""Request streams for the simulator: synthetic multi-turn chat or a JSONL trace.

Every rank replays the same list of :class:`SimRequest` in the same order
(the SGLang contract: identical scheduler decisions on every CP rank).

Synthetic chat (:func:`synthetic_chat`): a few shared system prompts
(``groups``); each request either starts a conversation (system prompt + user
turn), extends one (the whole history + assistant reply + next user turn), or
forks one at an earlier turn (same history up to there, a different user turn).
Lengths are in tokens and deliberately not page-aligned.

Trace (:func:`load_trace`): one JSON object per line, either
``{"tokens": [int, ...]}`` or
``{"prompt_len": int, "prefix_group": str | int, "shared_len": int}``
(``shared_len`` optional, default ``prompt_len // 2``): the first
``shared_len`` tokens come from the group's deterministic token stream (so two
requests of one group share ``min`` of their ``shared_len``), the rest are
unique to the line. Other keys are ignored; blank lines are skipped.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "ChatShape",
    "SimRequest",
    "TraceError",
    "VOCAB_SIZE",
    "load_trace",
    "synthetic_chat",
]

VOCAB_SIZE = 32_000
_MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class SimRequest:
    tokens: tuple[int, ...]
    label: str = ""  # "new:g1", "extend", "fork", "trace:12" ...

    def __len__(self) -> int:
        return len(self.tokens)


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _group_stream(group: str, n: int) -> tuple[int, ...]:
    digest = hashlib.sha256(f"prefix_group:{group}".encode()).digest()
    return _tokens(random.Random(int.from_bytes(digest[:8], "little")), n)


def _parse_line(obj: Any, path: str, line_no: int, seed: int) -> SimRequest:
    def fail(message: str) -> TraceError:
        return TraceError(path, line_no, message)

    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not tokens:
            raise fail("'tokens' must be a non-empty list of integers")
        for i, t in enumerate(tokens):
            if not _is_int(t) or not 0 <= t <= _MAX_TOKEN_ID:
                raise fail(f"'tokens'[{i}] must be an integer in [0, {_MAX_TOKEN_ID}], got {t!r}")
        return SimRequest(tuple(tokens), f"trace:{line_no}")
    if "prompt_len" not in obj:
        raise fail("expected a 'tokens' list or a 'prompt_len' (with 'prefix_group')")
    prompt_len = obj["prompt_len"]
    if not _is_int(prompt_len) or prompt_len < 1:
        raise fail(f"'prompt_len' must be a positive integer, got {prompt_len!r}")
    if "prefix_group" not in obj:
        raise fail("'prompt_len' needs a 'prefix_group' (string or integer)")
    group = obj["prefix_group"]
    if isinstance(group, bool) or not isinstance(group, (str, int)):
        raise fail(f"'prefix_group' must be a string or an integer, got {group!r}")
    shared = obj.get("shared_len", prompt_len // 2)
    if not _is_int(shared) or not 0 <= shared <= prompt_len:
        raise fail(f"'shared_len' must be an integer in [0, prompt_len={prompt_len}], got {shared!r}")
    own = random.Random(seed * 1_000_003 + line_no)
    tokens = _group_stream(str(group), shared) + _tokens(own, prompt_len - shared)
    return SimRequest(tokens, f"trace:{line_no}")


def load_trace(
    path: str | Path,
    *,
    seed: int,
    max_tokens: Optional[int] = None,
    limit: Optional[int] = None,
) -> list[SimRequest]:
    """Parse a JSONL trace; raise :class:`TraceError` naming the first bad line.

    ``max_tokens``: longest request the simulated device can hold.
    ``limit``: keep only the first ``limit`` requests.
    """
    path = str(path)
    out: list[SimRequest] = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(path, None, f"cannot read the trace: {exc.strerror or exc}") from None
    with handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(path, line_no, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
            req = _parse_line(obj, path, line_no, seed)
            if max_tokens is not None and len(req) > max_tokens:
                raise TraceError(
                    path, line_no,
                    f"request has {len(req)} tokens but the simulated device holds at most "
                    f"{max_tokens} (raise --device-pages)",
                )
            out.append(req)
    if not out:
        raise TraceError(path, None, "the trace holds no requests")
    return out
