"""N CP ranks of real SGLang 0.5.18 CpHiRadixCache stacks in one process.

Every rank replays the same operations (the SGLang contract: identical
scheduler decisions on every rank). Each rank writes content only into the
device pages it owns, derived from (token position, prefix seed), so restored
bytes can be checked against what they must be.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_hicache.sglang.stack import CpStackConfig, build_cp_rank_stack
from sglang_fixtures import content_mismatches, write_content


@dataclass
class LoadBackReport:
    tokens: list
    loaded_per_rank: list = field(default_factory=list)


class CpCluster:
    def __init__(self, config: CpStackConfig) -> None:
        self.config = config
        self.stacks = [build_cp_rank_stack(config, r) for r in range(config.cp_size)]

    def close(self) -> None:
        for s in self.stacks:
            s.close()

    @property
    def caches(self):
        return [s.cache for s in self.stacks]

    # content: position i of a sequence with seed s is pattern(i, s)
    def _fill(self, stack, locs: torch.Tensor, positions: torch.Tensor, seed: int) -> None:
        lay = stack.allocator.layout
        mask = lay.owned_by_this_rank(locs)
        if bool(mask.any()):
            write_content(stack.kv_pool, lay.logical_locs_to_physical(locs[mask]), positions[mask], seed=seed)

    def mismatches(self, stack, locs: torch.Tensor, positions: torch.Tensor, seed: int) -> list[str]:
        lay = stack.allocator.layout
        mask = lay.owned_by_this_rank(locs)
        if not bool(mask.any()):
            return []
        return content_mismatches(stack.kv_pool, lay.logical_locs_to_physical(locs[mask]), positions[mask], seed=seed)

    def insert(self, tokens: list[int], seed: int) -> list[torch.Tensor]:
        """Prefill a whole sequence (new pages for the part not on device)."""
        out = []
        for s in self.stacks:
            c = s.cache
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            hit = len(m.device_indices)
            need = len(tokens) - hit
            if s.allocator.available_size() < need:
                c.evict(EvictParams(num_tokens=need))
            new = s.allocator.alloc(need)
            assert new is not None, "device pool exhausted in test workload"
            locs = torch.cat([m.device_indices, new])
            self._fill(s, new, torch.arange(hit, len(tokens)), seed)
            c.insert(InsertParams(key=RadixKey(tokens), value=locs))
            # like the scheduler: free duplicate pages the tree already had
            out.append(locs)
        self.step()
        return out

    def step(self) -> None:
        for c in self.caches:
            c.writing_check()
            c.loading_check()

    def evict_device(self, num_tokens: int) -> list:
        return [c.evict(EvictParams(num_tokens=num_tokens)) for c in self.caches]

    def load_back(self, tokens: list[int]) -> LoadBackReport:
        report = LoadBackReport(tokens)
        for c in self.caches:
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            vals, last = c.init_load_back(
                InitLoadBackParams(best_match_node=m.last_host_node, host_hit_length=m.host_hit_length)
            )
            c.ready_to_load_host_cache()
            report.loaded_per_rank.append((m.device_indices, vals, m.host_hit_length))
        self.step()
        return report

    def device_locs(self, tokens: list[int]) -> list[torch.Tensor]:
        return [
            c.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices for c in self.caches
        ]

    def check(self, tokens: list[int], seed: int) -> dict:
        """Bytes of every on-device token of ``tokens`` on the rank that owns it."""
        bad = {}
        for s, locs in zip(self.stacks, self.device_locs(tokens)):
            errs = self.mismatches(s, locs, torch.arange(len(locs)), seed)
            if errs:
                bad[s.cp_rank] = errs
        return bad

    def ack_counts(self) -> list[tuple[int, int]]:
        return [(c.cp_transfer.stats.writes, c.cp_transfer.stats.loads) for c in self.caches]

    def tree_shape(self, cache) -> list:
        out = []
        stack = [(cache.root_node, ())]
        while stack:
            node, path = stack.pop()
            for k, child in sorted(node.children.items(), key=lambda kv: str(kv[0])):
                p = path + (tuple(child.key.token_ids[:1]), len(child.key))
                out.append((p, child.evicted, child.backuped, child.host_len))
                stack.append((child, p))
        return sorted(out)
