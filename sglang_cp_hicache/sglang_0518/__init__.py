"""The SGLang 0.5.18 adapter: only what a server runs.

``hiradix`` (CpHiRadixCache), ``allocator`` (the CP shared token allocator),
``transfer_adapter`` (SGLang's queues, with undo handles), ``host_copies``
(CP copies through this library's kernels), ``plugin`` (the
``sglang.srt.plugins`` entry point), ``checks`` (start-up refusals). The CPU
harness lives in ``sglang_cp_hicache.testing``. Importing this package does
not import sglang; its modules do.
"""

from __future__ import annotations

from sglang_cp_hicache import settings

#: The release whose HiRadixCache / HybridCacheController these subclasses follow.
SUPPORTED_SGLANG = "0.5.18"

__all__ = ["SUPPORTED_SGLANG", "check_sglang_version"]


def check_sglang_version(version: str | None = None) -> None:
    """Refuse an SGLang release the CP subclasses were not written against.

    ``SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG=1`` turns the error into a no-op
    (at your own risk: the copied tree-edit methods follow 0.5.18).
    """
    if version is None:
        import sglang

        version = sglang.__version__
    if version != SUPPORTED_SGLANG and not settings.enabled(settings.ALLOW_ANY_SGLANG):
        raise RuntimeError(
            f"sglang-cp-hicache supports sglang=={SUPPORTED_SGLANG}, found {version}; "
            "set SGLANG_CP_HICACHE_ALLOW_ANY_SGLANG=1 to try anyway"
        )
