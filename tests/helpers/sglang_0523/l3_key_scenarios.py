"""The L3 deployment secret on SGLang 0.5.23's sharded stack, in 2 rank
processes (:func:`key_suite`): each run builds the rank's stack (the
strategy's ``open_l3`` reads ``SGLANG_CP_HICACHE_L3_KEY_FILE`` from the
rank's environment, as a server's scheduler process does) and serves one
chain with the simulator's rank engine, which makes the scheduler's storage
calls and verifies every restored page this rank owns (KV and indexer rows).

1. CP 2 with the key writes the chain to ``keyed``;
2. rank 0 copies it twice and forges page :data:`FORGED` (its KV object in
   one copy, its indexer object in the other) as someone without the key can;
3. CP 2 readers: the same key on ``keyed``, the same key on each forged
   copy, another key and no key on ``keyed``; readers store nothing (what is
   restored can only be the writer's);
4. two bad key files on both ranks, then a bad one on rank 1 only, then
   sound key files with different secrets: the stack build's error on each
   rank, and every log message the build emitted.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from sglang_cp_hicache.l3.envelope import HEADER_BYTES

from tests.helpers.l3_key import forge_without_the_key
from tests.helpers.sglang_0523.l3_scenarios import _stack

P = 64
#: Pages of the chain; the scheduler looks up at most len - 1 tokens, hence the extra token.
PAGES = 8
TOKENS = list(range(5000, 5000 + PAGES * P + 1))
#: The forged page's index in the chain.
FORGED = 3


def _use_key(key_path: Optional[str]) -> None:
    from sglang_cp_hicache import settings

    if key_path is None:
        os.environ.pop(settings.L3_KEY_FILE.name, None)
    else:
        os.environ[settings.L3_KEY_FILE.name] = key_path


def _serve(rank: int, group: Any, l3_dir: str, key_path: Optional[str], *, store: bool) -> dict[str, Any]:
    """One CP 2 rank serving TOKENS with L3 in ``l3_dir`` and the key file
    ``key_path`` (None: no key); ``store``: its L3 writes run."""
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine

    _use_key(key_path)
    stack = _stack(2, rank, group, l3_dir)
    refusals, tier_log = _Messages(), logging.getLogger("sglang_cp_hicache.l3.host_tier")
    tier_log.addHandler(refusals)  # its "L3 object of ... rejected (<reason>)" warnings
    try:
        engine = ShardedSimRankEngine(stack, content_seed=1)
        driver = stack.cp.l3
        owners: list[list[int]] = []
        start = driver.prefetcher.start

        def recorded(plan: Any, rid: Any = None) -> None:  # the pages' owners, fixed when a lookup starts
            owners.append(list(plan.owners))
            return start(plan, rid)

        driver.prefetcher.start = recorded
        if not store:
            driver.l3.writer.write = lambda hashes, owners_, slots, parent=None: None
        record = engine.serve(0, TOKENS)
        totals = engine.totals()  # waits for the last writes
        tier = driver.tier
        kv_keys, idx_keys = tier.chain_keys(tier.page_hashes(TOKENS))
        return {
            "counters": driver.counters.as_dict(),
            "refusals": [m for m in refusals.messages if "rejected (" in m],
            "describe": tier.describe(),
            "owners": owners,
            "l3_hit_tokens": record.l3_hit_tokens,
            "corrupted_pages": record.corrupted_pages,
            "verified_pages": record.verified_pages,
            "l3_pages_verified": record.l3_pages_verified,
            "invariant_violations": totals.invariant_violations,
            "digest": totals.tree_digest,
            "kv_keys": kv_keys, "indexer_keys": idx_keys,
            "paths": [str(tier.store.path_of(k)) for k in (kv_keys[FORGED], idx_keys[FORGED], kv_keys[0],
                                                             idx_keys[0])],
        }
    finally:
        tier_log.removeHandler(refusals)
        stack.close()


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(self.format(record))


def _refused(rank: int, group: Any, l3_dir: str, key_path: str) -> dict[str, Any]:
    """The stack build's outcome with a bad key file, and every log line it wrote."""
    _use_key(key_path)
    handler, root = _Messages(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        _stack(2, rank, group, l3_dir).close()
        error: Optional[str] = None
    except ValueError as exc:  # CpAgreementError too
        error = f"{type(exc).__name__}: {exc}\n{exc!r}"
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return {"error": error, "log": handler.messages}


def key_suite(rank: int, world: int, *, root: str, key: str, other_key: str, bad_keys: dict[str, str],
              ) -> dict[str, Any]:
    from tests.helpers.sglang_0523.scenarios import _setup

    _setup()
    import torch.distributed as dist

    assert world == 2
    group, base = dist.group.WORLD, Path(root)
    out: dict[str, Any] = {"write": _serve(rank, group, str(base / "keyed"), key, store=True)}
    dist.barrier()
    if rank == 0:
        kv_forged, idx_forged, kv_first, idx_first = (Path(p) for p in out["write"]["paths"])
        for pool, forged, genuine in (("kv", kv_forged, kv_first), ("indexer", idx_forged, idx_first)):
            copy = base / f"forged_{pool}"
            shutil.copytree(base / "keyed", copy)
            # the payload of the chain's first page: genuine bytes of this pool, the wrong ones here
            payload = genuine.read_bytes()[HEADER_BYTES:]
            forge_without_the_key(copy / forged.relative_to(base / "keyed"), payload)
    dist.barrier()
    out["same_key"] = _serve(rank, group, str(base / "keyed"), key, store=False)
    for pool in ("kv", "indexer"):
        out[f"forged_{pool}"] = _serve(rank, group, str(base / f"forged_{pool}"), key, store=False)
    out["other_key"] = _serve(rank, group, str(base / "keyed"), other_key, store=False)
    out["no_key"] = _serve(rank, group, str(base / "keyed"), None, store=False)
    for name, path in bad_keys.items():
        out[f"bad:{name}"] = _refused(rank, group, str(base / "never"), path)
    # only rank 1's key file is bad: its problem is its agreement view, both ranks stop at once
    started = time.monotonic()
    out["bad:rank-1"] = _refused(rank, group, str(base / "never"), bad_keys["mode-0644"] if rank == 1 else key)
    out["bad:rank-1"]["seconds"] = time.monotonic() - started
    # a secret per host: both ranks' key files are sound, their secrets differ
    started = time.monotonic()
    out["two_secrets"] = _refused(rank, group, str(base / "never"), other_key if rank == 1 else key)
    out["two_secrets"]["seconds"] = time.monotonic() - started
    return out
