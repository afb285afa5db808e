"""What ``python -m sglang_cp_hicache check`` asks of an SGLang 0.5.23
prefill worker's launch arguments, as parsed by 0.5.23's own argument
parser (an ``argparse.Namespace``: SGLang's resolution has not run, so a
flag left unset reads as its parser default).

The library's copy path is built only on upstream's KV-sharded DSA HiCache
stack, so the stack's switches are required; upstream's own refusals of
that stack (``arg_groups/kv_shard_hook.py``) are checked on the fields they
read that need neither a GPU nor the model's config; the storage backend
goes through the adapter's own rule (:func:`~sglang_cp_hicache.l3.location.l3_location`;
:mod:`.l3_cache` is not imported: it loads SGLang's cache modules, seconds). Findings are plain
``(level, what, text)`` tuples: this package does not import the CLI.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache import settings
from sglang_cp_hicache.kernels import HOST_LAYOUTS
from sglang_cp_hicache.l3.location import l3_location
from sglang_cp_hicache.placement import DSA_PAGE_SIZE

__all__ = ["kernel_config", "launch_findings"]

Finding = tuple[str, str, str]

#: KV row of the TRTLLM fp8_e4m3 latent KV sharding requires (bytes);
#: indexer bytes per token.
_KV_ROW_BYTES, _INDEXER_BYTES_PER_TOKEN = 576, 132
#: The host layouts both upstream's sharded stack and the kernels accept.
_LAYOUTS = tuple(x for x in ("layer_first", "page_first") if x in HOST_LAYOUTS)

#: (flags, requirement met?, what to pass): the stack the library serves,
#: then upstream's refusals of KV sharding with DSA HiCache.
_REQUIREMENTS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("--enable-kv-cache-sharding", lambda a: a.enable_kv_cache_sharding,
     "the library's copy path exists only on the KV-sharded stack; pass --enable-kv-cache-sharding"),
    ("--enable-hierarchical-cache", lambda a: a.enable_hierarchical_cache,
     "no HiCache, nothing for the library to copy; pass --enable-hierarchical-cache"),
    ("--disaggregation-mode", lambda a: a.disaggregation_mode == "prefill",
     "KV sharding runs on PD prefill workers only; pass --disaggregation-mode prefill"),
    ("prefill CP (--enable-prefill-cp --attn-cp-size --cp-strategy --pp-size)",
     lambda a: a.enable_prefill_cp and a.attn_cp_size > 1 and a.cp_strategy == "interleave" and a.pp_size == 1,
     "upstream requires interleave prefill CP > 1 with PP 1; pass --enable-prefill-cp --attn-cp-size N "
     "--cp-strategy interleave"),
    ("--tp-size / --attn-cp-size", lambda a: a.attn_cp_size >= 1 and a.tp_size % a.attn_cp_size == 0,
     "--tp-size must be divisible by --attn-cp-size"),
    ("--dsa-prefill-backend / --dsa-decode-backend",
     lambda a: (a.dsa_prefill_backend, a.dsa_decode_backend) == ("trtllm", "trtllm"),
     "upstream requires TRTLLM DSA backends; pass --dsa-prefill-backend trtllm --dsa-decode-backend trtllm"),
    ("--kv-cache-dtype", lambda a: a.kv_cache_dtype == "fp8_e4m3", "upstream requires fp8_e4m3 KV; pass it"),
    ("--page-size", lambda a: a.page_size == DSA_PAGE_SIZE,
     f"upstream requires pages of {DSA_PAGE_SIZE}; pass --page-size {DSA_PAGE_SIZE}"),
    ("--disaggregation-transfer-backend", lambda a: a.disaggregation_transfer_backend == "mooncake",
     "upstream's DSA KV sharding requires Mooncake; pass --disaggregation-transfer-backend mooncake"),
    ("--hicache-io-backend", lambda a: a.hicache_io_backend == "kernel",
     "sharded DSA HiCache and the library's kernels need kernel I/O; pass --hicache-io-backend kernel"),
    ("--hicache-mem-layout", lambda a: a.hicache_mem_layout in _LAYOUTS,
     f"sharded DSA HiCache takes {' or '.join(_LAYOUTS)}; pass one of them"),
    ("--hicache-host-memory-mode", lambda a: a.hicache_host_memory_mode == "cache",
     "sharded DSA HiCache requires host memory mode cache; pass --hicache-host-memory-mode cache"),
    ("--radix-cache-backend", lambda a: a.radix_cache_backend is None,
     "KV sharding uses upstream's built-in radix cache; drop --radix-cache-backend"),
    ("--dcp-size", lambda a: a.dcp_size == 1, "KV sharding excludes decode CP; drop --dcp-size"),
    ("--enable-dsa-cache-layer-split", lambda a: not a.enable_dsa_cache_layer_split,
     "upstream refuses DSA cache layer splitting under KV sharding; drop it"),
    ("--chunked-prefill-size", lambda a: a.chunked_prefill_size is None or a.chunked_prefill_size > 0,
     "KV sharding requires chunked prefill (SGLang's default); drop --chunked-prefill-size or make it > 0"),
)


def _requirement(flags: str, met: Callable[[Any], bool], fix: str, args: Any) -> Finding:
    shown = ", ".join(f"{name}={getattr(args, name)!r}" for name in _fields_of(flags) if hasattr(args, name))
    if met(args):
        return ("OK", flags, shown)
    return ("FAIL", flags, f"{shown}: {fix}")


def _fields_of(flags: str) -> list[str]:
    return [word.strip("(),").removeprefix("--").replace("-", "_") for word in flags.split()
            if word.strip("(),").startswith("--")]


def _copy_path() -> Finding:
    try:
        path = settings.read(settings.COPY)
    except ValueError as exc:
        return ("FAIL", settings.COPY.name, str(exc))
    if path == "library":
        return ("OK", settings.COPY.name, "library (this library's kernels and bookkeeping)")
    return ("WARN", settings.COPY.name, "upstream: this server keeps SGLang's own copies (the library only joins "
                                        "the start-up agreement); unset it for the library's copy path")


def _storage(args: Any) -> Finding:
    what = "--hicache-storage-backend"
    try:  # the adapter's rule (l3.opening.SERVED_BACKENDS is l3_location's SUPPORTED_BACKENDS)
        l3_location(args.hicache_storage_backend, args.hicache_storage_backend_extra_config)
    except ValueError as exc:
        return ("FAIL", what, str(exc))
    if not args.hicache_storage_backend:
        return ("OK", what, "none (no L3)")
    if _copy_path()[0] == "WARN":  # storage_lift lifts upstream's refusal for the library's path only
        return ("FAIL", what, f"{args.hicache_storage_backend!r} with {settings.COPY.name}=upstream: upstream's KV "
                              "sharding refuses a storage backend; only the library's copy path serves it (unset "
                              f"{settings.COPY.name}, or drop the flag)")
    return ("OK", what, f"{args.hicache_storage_backend} (served by the library's L3)")


def launch_findings(args: Any) -> list[Finding]:
    """One finding per requirement of the library's stack on 0.5.23's parsed launch arguments."""
    return ([_copy_path()] + [_requirement(flags, met, fix, args) for flags, met, fix in _REQUIREMENTS]
            + [_storage(args)])


def kernel_config(args: Any) -> dict[str, Any]:
    """``kernels.transfer.warmup`` arguments for this server's pools (one
    layer: the specialisation does not depend on the layer count)."""
    import torch

    page = args.page_size or DSA_PAGE_SIZE
    return dict(page_size=page, host_layout=args.hicache_mem_layout, num_layers=1, kv_dim=_KV_ROW_BYTES,
                kv_dtype=torch.uint8, indexer_page_bytes=_INDEXER_BYTES_PER_TOKEN * page)
