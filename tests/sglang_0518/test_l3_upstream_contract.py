"""Why the 0.5.18 L3 lookup keeps the ``remember_match`` side channel, pinned
against the installed SGLang source.

A request with an ``extra_key`` (a LoRA adapter) or a cache salt must never
look up L3 (its pages are another namespace's). Below a node, the node's
key says which namespace; at the root nothing does, and SGLang 0.5.18's
scheduler hands ``prefetch_from_storage`` only the request's id, the node
and token ids. The request's key (extra key included) reaches the cache
once, in the ``match_prefix`` that ``init_next_round_input`` runs just
before: the cache keeps that key. When a release passes the request, its
key or its extra key to ``prefetch_from_storage``, these tests fail: the
side channel can go then."""

from __future__ import annotations

import ast
import inspect
import textwrap

from sglang_cp_hicache.testing.stack_0518 import CpStackConfig  # noqa: F401  (makes SGLang importable here)
from tests.helpers.scheduler_import import scheduler_class

Scheduler = scheduler_class()

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # noqa: E402


def _function(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == name]


def test_the_scheduler_passes_no_request_key_to_prefetch_from_storage():
    body = _function(Scheduler._prefetch_kvcache)
    (call,) = _calls(body, "prefetch_from_storage")
    passed = [ast.unparse(a) for a in call.args] + [ast.unparse(k.value) for k in call.keywords]
    assert passed[:3] == ["req.rid", "req.last_host_node", "new_input_tokens"], passed
    assert not any(p == "req" or "extra_key" in p or "cache_salt" in p or "origin_input" in p for p in passed), passed
    params = list(inspect.signature(HiRadixCache.prefetch_from_storage).parameters)
    assert params == ["self", "req_id", "last_host_node", "new_input_tokens", "last_hash", "prefix_keys"]


def test_the_requests_key_reaches_the_cache_only_through_the_match_just_before():
    body = _function(Scheduler._prefetch_kvcache)
    order = [c for c in ast.walk(body) if isinstance(c, ast.Call) and getattr(c.func, "attr", None)
             in ("init_next_round_input", "prefetch_from_storage")]
    assert [c.func.attr for c in sorted(order, key=lambda c: c.lineno)] == [
        "init_next_round_input", "prefetch_from_storage"]
    (match,) = _calls(_function(Req.init_next_round_input), "match_prefix")
    assert "extra_key=self.extra_key" in ast.unparse(match)
