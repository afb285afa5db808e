"""What ``python -m sglang_cp_hicache check`` asks of an SGLang 0.5.18
server's launch arguments, as parsed by 0.5.18's own argument parser (an
``argparse.Namespace``: ``ServerArgs.__post_init__`` has not run, so a flag
left unset reads as its parser default, e.g. ``page_size`` None).

Each check reuses the refusal the adapter makes at start-up where there is
one (:func:`.checks.check_cp_hicache_server_args`, the factory's
``--enable-hierarchical-cache`` refusal, the DSA page size); the CP flags
are those the README's launch line sets. Findings are plain
``(level, what, text)`` tuples: this package does not import the CLI.
"""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.kernels import HOST_LAYOUTS
from sglang_cp_hicache.placement import DSA_PAGE_SIZE
from sglang_cp_hicache.sglang_0518.checks import check_cp_hicache_server_args
from sglang_cp_hicache.sglang_0518.plugin import BACKEND_NAME

__all__ = ["kernel_config", "launch_findings"]

Finding = tuple[str, str, str]

#: KV row of 0.5.18's DSA device pool: fp8 (512 + 4 x 4 scale bytes + 64 x 2
#: rope bytes) or bf16 (512 + 64 elements); indexer bytes per token.
_KV_ROW_FP8, _KV_ROW_BF16, _INDEXER_BYTES_PER_TOKEN = 656, 576, 132


def _backend(args: Any) -> Finding:
    got = args.radix_cache_backend
    if got == BACKEND_NAME:
        return ("OK", "--radix-cache-backend", f"{BACKEND_NAME} (the library's CP cache)")
    return ("FAIL", "--radix-cache-backend",
            f"is {got!r}: the library's cache is built only by --radix-cache-backend {BACKEND_NAME}; pass it")


def _hierarchical(args: Any) -> Finding:
    if args.enable_hierarchical_cache:
        return ("OK", "--enable-hierarchical-cache", "on")
    return ("FAIL", "--enable-hierarchical-cache",
            f"off: --radix-cache-backend {BACKEND_NAME} refuses to build the CP cache without it; pass it")


def _storage_and_policy(args: Any) -> Finding:
    what = "--hicache-storage-backend / --hicache-write-policy"
    try:
        check_cp_hicache_server_args(args, cp_shared_kv=True)  # the cache's own start-up refusal
    except ValueError as exc:
        return ("FAIL", what, str(exc))
    return ("OK", what, f"{args.hicache_storage_backend or 'no L3'}, {args.hicache_write_policy}")


def _prefill_cp(args: Any) -> Finding:
    what = "prefill CP (--enable-prefill-cp --attn-cp-size --cp-strategy)"
    cp, tp = args.attn_cp_size, args.tp_size
    enabled = args.enable_prefill_cp or getattr(args, "enable_dsa_prefill_context_parallel", False)
    if not enabled or cp <= 1:
        return ("FAIL", what, f"enable_prefill_cp={enabled}, attn_cp_size={cp}: CP shared KV needs prefill CP "
                              "over N > 1 ranks; pass --enable-prefill-cp --attn-cp-size N --cp-strategy interleave")
    if args.cp_strategy != "interleave":
        return ("FAIL", what, f"--cp-strategy {args.cp_strategy!r}: pages are owned page % N, which is the "
                              "interleave strategy; pass --cp-strategy interleave")
    if tp % cp:
        return ("FAIL", what, f"--tp-size {tp} is not divisible by --attn-cp-size {cp}; pick sizes that divide")
    return ("OK", what, f"{cp} ranks, interleave, tp {tp}")


def _page_size(args: Any) -> Finding:
    got = args.page_size
    if got == DSA_PAGE_SIZE:
        return ("OK", "--page-size", f"{got}")
    if got is None:
        return ("WARN", "--page-size", f"not given: SGLang resolves it from the model at launch; the CP cache "
                                       f"needs {DSA_PAGE_SIZE} (the DSA pool's), pass --page-size {DSA_PAGE_SIZE}")
    return ("FAIL", "--page-size", f"{got}: the DSA pool and the CP allocator use pages of {DSA_PAGE_SIZE} tokens; "
                                   f"pass --page-size {DSA_PAGE_SIZE}")


def _host_layout(args: Any) -> Finding:
    got = args.hicache_mem_layout
    if got in HOST_LAYOUTS:
        return ("OK", "--hicache-mem-layout", got)
    return ("FAIL", "--hicache-mem-layout", f"{got!r}: the copy kernels support {', '.join(HOST_LAYOUTS)}; "
                                            "pass one of them")


def launch_findings(args: Any) -> list[Finding]:
    """One finding per requirement of the CP cache on 0.5.18's parsed launch arguments."""
    return [check(args) for check in (_backend, _hierarchical, _storage_and_policy, _prefill_cp, _page_size,
                                      _host_layout)]


def kernel_config(args: Any) -> dict[str, Any]:
    """``kernels.transfer.warmup`` arguments for this server's pools (one
    layer: the specialisation does not depend on the layer count)."""
    import torch

    page = args.page_size or DSA_PAGE_SIZE
    fp8 = str(args.kv_cache_dtype).startswith("fp8")
    return dict(page_size=page, host_layout=args.hicache_mem_layout, num_layers=1,
                kv_dim=_KV_ROW_FP8 if fp8 else _KV_ROW_BF16, kv_dtype=torch.uint8 if fp8 else torch.bfloat16,
                indexer_page_bytes=_INDEXER_BYTES_PER_TOKEN * page)
