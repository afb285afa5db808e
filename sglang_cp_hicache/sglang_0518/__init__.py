"""The SGLang 0.5.18 adapter: only what a server runs.

* ``hiradix`` -- :class:`CpHiRadixCache`, built and checked at start-up
  (hooks, settings, the one all-gather agreement of the CP ranks); it owns
  one collaborator per concern, each holding its own state and handed what
  it talks to, and every SGLang method it overrides delegates to one:
  ``host_tier`` (host ledger, host leaves, host eviction, lane reclaim),
  ``write_through`` (backups, the CPU page mirror, taking writes back),
  ``load_back`` (owner-preserving restores, the quota, taking load-backs
  back), ``step_protocol`` (the step's all-reduce: when to take back),
  ``l3_cache`` (where SGLang calls the L3 tier in: writes, lookups, the
  scheduler's prefetch calls, metrics) / ``l3_port`` (this release's port
  of the L3 prefetch protocol), and ``upstream_0518`` (the tree edits carried
  over from 0.5.18, each saying what differs); ``counters`` -- their counts;
* ``step_status`` -- the step status packed into SGLang's two ack counts;
* ``tree_node`` -- :class:`CpTreeNode`;
* ``allocator`` -- the CP shared token allocator (owner lanes);
* ``transfer_adapter`` -- CP writes and loads on SGLang's queues, with undo
  handles; ``host_copies`` -- CP copies through this library's kernels,
  bound on one cache's host pool instances;
* ``hooks`` -- every SGLang name the adapter depends on, checked at start-up;
* ``plugin`` -- the ``sglang.srt.plugins`` entry point; ``checks`` --
  start-up refusals of server settings.

The CPU harness lives in ``sglang_cp_hicache.testing``. Importing this
package (or ``hooks``) does not import sglang; the other modules do.
"""

from __future__ import annotations

from sglang_cp_hicache import releases

#: The release whose HiRadixCache / HybridCacheController these subclasses follow.
SUPPORTED_SGLANG = "0.5.18"

__all__ = ["SUPPORTED_SGLANG", "check_sglang_version"]


def check_sglang_version(version: str | None = None) -> None:
    """Refuse an SGLang release the CP subclasses were not written against
    (``version`` None: the installed one)."""
    import sglang

    releases.check_sglang_version(SUPPORTED_SGLANG, sglang.__version__ if version is None else version)