"""Warm-up at server start and offline compilation of the page-copy kernel.

:func:`warmup` makes the first real copy of a pool configuration pay nothing:

* ``triton`` (CUDA): compiles every specialisation the configuration uses,
  launching nothing; binaries land in Triton's cache dir
  (``TRITON_CACHE_DIR``), so a restarted server loads them from disk;
* ``triton-interpret`` (CPU, ``TRITON_INTERPRET=1``): runs each operation once
  on one-page stand-in buffers, which loads the interpreter twin of the kernel
  and rewrites its functions once;
* ``reference`` (CPU): nothing to do.

:func:`compile_offline` compiles the same specialisations for a given GPU
target on a machine without a GPU (the tests read the PTX).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import triton

from . import _checks, _twin
from . import _triton_launch
from . import _launch_spec as _spec
from ._backend import select_backend
from ._checks import PoolGeometry
from ._launch_spec import LaunchPlan
from ._triton_launch import DEFAULT_NUM_CTAS
from sglang_cp_hicache.placement import CpPlacement

__all__ = ["OPS", "WarmupReport", "compile_offline", "warmup"]

#: Operation names, in the order warm-up runs them.
OPS = ("kv_d2h", "kv_h2d", "indexer_d2h", "indexer_h2d")


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` did for one pool configuration."""

    backend: str  # "triton", "triton-interpret" or "reference"
    ops: list[str] = field(default_factory=list)  # operations compiled (or run once), e.g. "kv_d2h"
    compiled: int = 0  # len(ops)
    seconds: float = 0.0
    cache_dir: str | None = None  # Triton's cache dir for compiled kernels; None otherwise
    config: dict = field(default_factory=dict)  # the arguments, JSON-ready

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _StandIn:
    """One operation on one-page stand-in buffers."""

    op: str
    plan: LaunchPlan
    locs: torch.Tensor
    placement: CpPlacement

    def spec(self, block_bytes: int) -> _spec.Spec:
        part = _spec.pool_part(self.plan, self.placement.page_size, block_bytes)
        return _spec.specialise(part, self.locs, self.locs, self.placement, DEFAULT_NUM_CTAS)


def _stand_ins(
    *, page_size: int, host_layout: str, num_layers: int, kv_dim: int | None, kv_dtype: torch.dtype | None,
    indexer_page_bytes: int | None, device: torch.device, pin_memory: bool,
) -> list[_StandIn]:
    """One stand-in launch per operation a pool configuration uses.

    The kernel's specialisation depends only on constexprs derived from page
    size, row bytes, host layout, word size and alignment. For a contiguous
    host pool every stride is a multiple of the row size, so one host page and
    one-page device layers specialise exactly like the real pools (every int
    argument is do_not_specialize, every pointer do_not_specialize_on_alignment).
    """
    placement = CpPlacement(page_size, 1, 0)
    locs = torch.arange(page_size, dtype=torch.int64, device=device)
    pools: list[tuple[str, PoolGeometry]] = []
    if kv_dim is not None:
        dev = [torch.zeros((page_size, 1, kv_dim), dtype=kv_dtype, device=device) for _ in range(num_layers)]
        shape = {
            "layer_first": (num_layers, page_size, 1, kv_dim),
            "page_first": (page_size, num_layers, 1, kv_dim),
            "page_first_direct": (1, num_layers, page_size, 1, kv_dim),
        }[host_layout]
        host = torch.zeros(shape, dtype=kv_dtype, pin_memory=pin_memory)
        geom = _checks.host_kv_geometry("host_kv", host, host_layout, page_size, kv_dim)
        pools.append(("kv", PoolGeometry(True, tuple(dev), host, host_layout, geom, 1)))
    if indexer_page_bytes is not None:
        dev = [torch.zeros((1, indexer_page_bytes), dtype=torch.uint8, device=device) for _ in range(num_layers)]
        if host_layout == "layer_first":
            shape = (num_layers, 1, indexer_page_bytes)
        else:
            shape = (1, num_layers, 1, indexer_page_bytes)
        host = torch.zeros(shape, dtype=torch.uint8, pin_memory=pin_memory)
        geom = _checks.host_index_geometry("host_index", host, host_layout, indexer_page_bytes)
        pools.append(("indexer", PoolGeometry(False, tuple(dev), host, host_layout, geom, 1)))
    out = []
    for name, pool in pools:  # the launchers' own plans: a backup of every layer, a load of layer 0
        out.append(_StandIn(f"{name}_d2h", _triton_launch.backup_plan(pool), locs, placement))
        out.append(_StandIn(f"{name}_h2d", _triton_launch.load_plan(pool, pool.device_layers[0], 0), locs, placement))
    return out


def _check_pool_config(page_size, host_layout, num_layers, kv_dim, kv_dtype, indexer_page_bytes,
                       block_bytes) -> int:
    """Check the pool configuration; the block size to launch with."""
    _checks.check_host_layout(host_layout)
    for name, value in (("page_size", page_size), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("kv_dim", kv_dim), ("indexer_page_bytes", indexer_page_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if kv_dim is None and indexer_page_bytes is None:
        raise ValueError("give kv_dim (with kv_dtype) and/or indexer_page_bytes")
    if kv_dim is not None and not isinstance(kv_dtype, torch.dtype):
        raise ValueError(f"kv_dtype must be a torch.dtype when kv_dim is given, got {kv_dtype!r}")
    return _triton_launch._check_num_ctas(None, block_bytes)[1]


def _cache_dir() -> str:
    # TRITON_CACHE_DIR if set, else Triton's default (~/.triton/cache), read now.
    return str(triton.knobs.cache.dir)


def warmup(
    *, page_size: int, host_layout: str, num_layers: int, kv_dim: int | None = None,
    kv_dtype: torch.dtype | None = None, indexer_page_bytes: int | None = None,
    device: torch.device | str | None = None, block_bytes: int | None = None,
) -> WarmupReport:
    """Get every kernel a pool configuration uses ready before serving.

    Covers KV backup + load (when ``kv_dim``/``kv_dtype`` are given) and
    indexer backup + load (when ``indexer_page_bytes`` is given) for
    ``host_layout``, on ``device`` (default: the current CUDA device, else the
    CPU) with the backend a copy there would use (see the module docstring).
    """
    block_bytes = _check_pool_config(page_size, host_layout, num_layers, kv_dim, kv_dtype, indexer_page_bytes,
                                     block_bytes)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    backend = select_backend(device)
    config = dict(
        page_size=page_size, host_layout=host_layout, num_layers=num_layers, kv_dim=kv_dim,
        kv_dtype=None if kv_dtype is None else str(kv_dtype).removeprefix("torch."),
        indexer_page_bytes=indexer_page_bytes, device=str(device), block_bytes=block_bytes,
    )
    t0 = time.perf_counter()
    if backend == "reference":
        return WarmupReport(backend, [], 0, 0.0, None, config)
    interpret = backend == "triton-interpret"
    stand_ins = _stand_ins(
        page_size=page_size, host_layout=host_layout,
        # the interpreter compiles nothing: one layer runs the same code
        num_layers=1 if interpret else num_layers,
        kv_dim=kv_dim, kv_dtype=kv_dtype, indexer_page_bytes=indexer_page_bytes,
        device=device, pin_memory=not interpret,
    )
    if interpret:
        for s in stand_ins:
            _triton_launch._launch(s.plan, s.locs, s.locs, s.placement, DEFAULT_NUM_CTAS, block_bytes)
        cache_dir = None
    else:
        kernel = _twin.kernel_for(False)
        with torch.cuda.device(device):
            for s in stand_ins:
                spec = s.spec(block_bytes)
                kernel.warmup(*spec.args, grid=spec.grid, **spec.meta)
        cache_dir = _cache_dir()
    ops = [s.op for s in stand_ins]
    return WarmupReport(backend, ops, len(ops), round(time.perf_counter() - t0, 4), cache_dir, config)


_TRITON_TYPES = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8"}


def compile_offline(
    target, *, page_size: int, host_layout: str, num_layers: int, kv_dim: int | None = None,
    kv_dtype: torch.dtype | None = None, indexer_page_bytes: int | None = None, block_bytes: int | None = None,
) -> dict:
    """Compile the specialisations of a pool configuration for ``target``
    (a ``triton.backends.compiler.GPUTarget``) without a GPU.

    Returns ``{"kv_d2h" | "kv_h2d" | "indexer_d2h" | "indexer_h2d": CompiledKernel}``;
    ``compiled.asm["ptx"]`` is the PTX. Used by the tests to check that the
    copy loops use 16-byte vector loads and stores on Hopper.
    """
    from triton.compiler import ASTSource

    block_bytes = _check_pool_config(page_size, host_layout, num_layers, kv_dim, kv_dtype, indexer_page_bytes,
                                     block_bytes)
    stand_ins = _stand_ins(
        page_size=page_size, host_layout=host_layout, num_layers=num_layers, kv_dim=kv_dim,
        kv_dtype=kv_dtype, indexer_page_bytes=indexer_page_bytes, device=torch.device("cpu"),
        pin_memory=False,
    )
    kernel = _twin.kernel_for(False)
    names = kernel.arg_names
    out = {}
    for s in stand_ins:
        spec = s.spec(block_bytes)
        meta = dict(spec.meta)
        num_warps = meta.pop("num_warps")
        signature = {}
        for name, arg in zip(names, spec.args):
            if isinstance(arg, torch.Tensor):
                signature[name] = "*" + _TRITON_TYPES[arg.dtype]
            else:  # every int argument is do_not_specialize: typed by range only
                signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
        for name in meta:
            signature[name] = "constexpr"
        src = ASTSource(kernel, signature, meta)
        out[s.op] = triton.compile(src, target=target, options={"num_warps": num_warps})
    return out
