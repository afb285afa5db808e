"""A minimal radix node satisfying sglang_cp_hicache.policy_0518.node_state.CpNode:
the 0.5.18 policy on plain ints and tensors, without SGLang (its tests and
``bench/bench_bookkeeping.py``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_ids = itertools.count()


@dataclass(eq=False)
class Node:
    key: Any = ()
    value: Optional[torch.Tensor] = None
    parent: Optional["Node"] = None
    children: dict = field(default_factory=dict)
    host_len: int = 0
    cp_hicache: Any = None
    lock_ref: int = 0
    host_ref_counter: int = 0
    last_access: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def evicted(self) -> bool:
        return self.value is None


def child_key(key: Any) -> Any:
    return key[0]


def attach(parent: Node, child: Node) -> Node:
    child.parent = parent
    parent.children[child_key(child.key)] = child
    return child
