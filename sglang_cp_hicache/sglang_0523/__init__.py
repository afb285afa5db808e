"""SGLang 0.5.23 adapter: this library's CP page-copy kernels in upstream's
KV-sharded (page-interleave) DSA HiCache copy path.

The only code that imports SGLang 0.5.23; importing this package itself does
not import sglang. Modules:

* :mod:`.copy_engine` -- an ``L2TransferEngine`` whose per-transfer copies are
  this library's fused mask-and-translate kernels;
* :mod:`.controller` -- a ``HybridCacheController`` that hands those kernels
  logical device locs (no host ``nonzero`` + device gather per transfer);
* :mod:`.strategy` -- the ``register_stack_strategy`` seam that builds the
  sharded DSA stack with them, and the start-up check that refuses to serve
  if any seam did not take;
* :mod:`.stack` -- ``CpStack0523``, the one record of what the build added
  (host room, device frees, run frees, warm-up, L3), and the list of the
  methods replaced on the stack's SGLang instances;
* :mod:`.hooks` -- the registry of every SGLang name the adapter overrides,
  replaces, calls or reads, checked when the stack is built;
* :mod:`.startup` -- the CP ranks' start-up agreement (one all-gather);
* :mod:`.host_room`, :mod:`.device_free`, :mod:`.request_free`,
  :mod:`.warmup` -- the owner-aware host room, device frees known by phase,
  a request's run frees, the copies' warm-up;
* :mod:`.l3_port` -- this release's side of the L3 prefetch protocol;
  :mod:`.l3_cache` -- the L3 entry: the driver on the cache instance (the
  scheduler's storage calls), its binding to the wing and its metrics;
  :mod:`.storage_lift` -- lets the storage flag through upstream's sharding
  check when the library serves it;
* :mod:`.library_metrics` -- the library's live metrics (``--enable-metrics``);
* :mod:`.preflight` -- what ``check`` asks of 0.5.23's launch arguments;
* :mod:`.plugin` -- the ``sglang.srt.plugins`` entry point.
"""

from __future__ import annotations

from sglang_cp_hicache import releases, settings

#: The release this adapter was written against (every SGLang name it
#: depends on: :data:`.hooks.HOOKS`).
SUPPORTED_SGLANG = "0.5.23"

#: ``1``: run on another SGLang release anyway (at your own risk).
ALLOW_ANY_ENV = settings.ALLOW_ANY_SGLANG.name

__all__ = ["ALLOW_ANY_ENV", "SUPPORTED_SGLANG", "check_sglang_version"]


def check_sglang_version(version: str | None = None) -> None:
    """Refuse an SGLang release this adapter was not written against (the
    installed one when ``version`` is None)."""
    import sglang

    releases.check_sglang_version(SUPPORTED_SGLANG, version or sglang.__version__)