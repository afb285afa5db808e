"""Triton, the GPU, and the copy kernels compiled once for this server's
pools (on the GPU, when there is one: that is what this check is for; on a
machine without one the kernels line says it was skipped and why)."""

from __future__ import annotations

import os
from typing import Any, Optional

from sglang_cp_hicache.preflight.report import FAIL, OK, WARN, Finding

__all__ = ["cache_origin", "device_findings", "kernel_findings", "triton_cache_dir", "triton_findings"]


def triton_findings() -> tuple[bool, list[Finding]]:
    """Whether Triton imports, and its line."""
    try:
        import triton
    except Exception as exc:  # an import error of any kind: the kernels cannot be built
        return False, [Finding(FAIL, "Triton", f"cannot be imported ({exc}); install the triton that matches torch")]
    return True, [Finding(OK, "Triton", f"{triton.__version__}")]


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels now: ``TRITON_CACHE_DIR``, else
    ~/.triton/cache, as Triton reads it (its default when it does not import)."""
    try:
        import triton

        return str(triton.knobs.cache.dir)
    except Exception:  # no Triton, or one without knobs: nothing is compiled anyway
        return os.path.join(os.path.expanduser("~"), ".triton", "cache")


def device_findings() -> tuple[bool, list[Finding]]:
    """Whether a CUDA GPU is visible to torch, and its line."""
    import torch

    if not torch.cuda.is_available():
        return False, [Finding(FAIL, "device", "no CUDA GPU visible (torch.cuda.is_available() is False): the copy "
                                               f"kernels cannot run here (torch {torch.__version__}, CUDA build "
                                               f"{torch.version.cuda}); run this check on the GPU server, with "
                                               "the CUDA_VISIBLE_DEVICES the server gets")]
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    return True, [Finding(OK, "device", f"{count} CUDA GPU(s), cuda:0 {name} (sm_{major}{minor}), torch "
                                       f"{torch.__version__}, CUDA {torch.version.cuda}")]


def cache_origin(before: str) -> str:
    """Why the Triton cache dir is what it is, given what it was before SGLang was imported."""
    return "SGLang's import sets it when TRITON_CACHE_DIR is unset, as in the server" if triton_cache_dir() != before \
        else ""


def kernel_findings(has_gpu: bool, has_triton: bool, config: Optional[dict[str, Any]],
                    origin: str = "") -> list[Finding]:
    """The copy kernels compiled once for ``config`` on cuda:0 (nothing launched);
    ``origin``: who chose the Triton cache dir (:func:`cache_origin`)."""
    what = "copy kernels"
    cache = f"{triton_cache_dir()}" + (f" ({origin})" if origin else "")
    if not (has_gpu and has_triton):
        why = "no CUDA GPU visible" if not has_gpu else "Triton cannot be imported"
        return [Finding(WARN, what, f"skipped: {why} (see above); on the GPU server they compile into the Triton "
                                    f"cache dir {cache}")]
    if config is None:
        return [Finding(WARN, what, "skipped: the launch arguments did not parse, so the pools are unknown")]
    from sglang_cp_hicache.kernels import HOST_LAYOUTS, transfer

    if config["host_layout"] not in HOST_LAYOUTS:
        return [Finding(WARN, what, f"skipped: host layout {config['host_layout']!r} has no kernel (see above)")]
    try:
        report = transfer.warmup(device="cuda:0", **config)
    except Exception as exc:  # a compile error of any kind is this check's finding
        return [Finding(FAIL, what, f"compiling for {config} failed: {type(exc).__name__}: {exc}; report it with "
                                    "python -m sglang_cp_hicache --version and the Triton version")]
    return [Finding(OK, what, f"{report.compiled} compiled ({', '.join(report.ops)}) in {report.seconds:.1f} s on "
                              f"{report.backend}; Triton cache dir {cache}")]
