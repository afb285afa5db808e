"""Context-parallel (CP shared KV) support for SGLang's hierarchical KV cache.

Importing this package needs only torch. What lives here is shared by both
SGLang releases: the page placement (``placement``: which CP rank owns a
logical page, and where it sits there), argument checks (``validation``) and
the library's settings (``settings``). The rooms above it:

* ``sglang_cp_hicache.kernels`` -- Triton page copies, their torch reference
  and the dispatcher ``kernels.transfer`` (both releases copy through it);
* ``sglang_cp_hicache.policy_0518`` -- the 0.5.18 adapter's policy, torch only;
* ``sglang_cp_hicache.sglang_0518`` -- the SGLang 0.5.18 adapter
  (``CpHiRadixCache``, a plugin, its hook registry);
* ``sglang_cp_hicache.sglang_0523`` -- the SGLang 0.5.23 adapter (a HiCache
  stack strategy on upstream's KV-sharded pool, its hook registry);
* ``sglang_cp_hicache.testing`` -- the CPU harness (tests and simulator only);
* ``sglang_cp_hicache.sim`` -- the multi-process simulator behind
  ``python -m sglang_cp_hicache simulate``.
"""

from sglang_cp_hicache.placement import DSA_PAGE_SIZE, CpPlacement

__all__ = ["DSA_PAGE_SIZE", "CpPlacement"]
__version__ = "0.1.0"
