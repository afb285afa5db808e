"""What a real SGLang HiCache stack needs around it on a CPU machine (both
CPU harnesses use these helpers: :mod:`.stack_0518` and :mod:`.stack_0523`).

SGLang 0.5.18's ``HiRadixCache(params, server_args)`` reads three things
besides its arguments (0.5.23's stack build needs the first two):

* a ``ServerArgs`` -- whose ``__post_init__`` loads ``config.json`` from
  ``model_path`` through transformers (a Hub name means a download) and sets
  several ``SGLANG_*`` environment variables;
* the published runtime context (``runtime_context.publish``): the host pool
  size comes from ``get_memory().hicache_ratio``;
* a process group for ``CacheInitParams.tp_cache_group`` --
  ``torch.distributed.get_world_size(group=...)`` runs in ``__init__``.

The helpers here provide each without side effects on the user's setup: a
two-key llama ``config.json`` shipped with the package, an
``os.environ`` snapshot restored around ``ServerArgs(...)``, and a one-rank
gloo group that never touches the default process group.

``os.environ`` is process-wide: ranks simulated as threads build their
``ServerArgs`` concurrently, and one thread's restore would delete the
variables another has just set (``KeyError`` inside ``ServerArgs``) or change
the C environment while another forks ``lscpu`` (``EFAULT``). Every
environment change here holds :data:`ENVIRON_LOCK`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import TYPE_CHECKING, Any, Iterator

import torch.distributed as dist

from sglang_cp_hicache.placement import DSA_PAGE_SIZE

if TYPE_CHECKING:
    from sglang.srt.runtime_context import RuntimeContext
    from sglang.srt.server_args import ServerArgs

__all__ = [
    "ENVIRON_LOCK",
    "TINY_MODEL_CONFIG",
    "make_cpu_server_args",
    "with_harness_deadlines",
    "make_local_gloo_group",
    "preserved_environ",
    "publish_server_args",
    "tiny_model_dir",
]

#: The smallest config.json ServerArgs 0.5.18 accepts: without "architectures"
#: its model-arch checks index None; without "model_type" transformers'
#: AutoConfig refuses the directory. Any other field is optional.
TINY_MODEL_CONFIG: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}

#: Held while ``os.environ`` may change: around every ``ServerArgs(...)``
#: built here and every :func:`preserved_environ` block. Re-entrant, so a
#: caller may hold it across several steps (build, then publish).
ENVIRON_LOCK = threading.RLock()

_TINY_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_model")


def tiny_model_dir() -> str:
    """The directory holding :data:`TINY_MODEL_CONFIG` as ``config.json``:
    shipped with the package (read-only use), so no process -- however it
    ends -- leaves a temporary directory behind."""
    path = os.path.join(_TINY_MODEL_DIR, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the CPU harness's tiny model config is missing: {path} (reinstall the package)")
    return _TINY_MODEL_DIR


@contextlib.contextmanager
def preserved_environ() -> Iterator[None]:
    """Undo every change to ``os.environ`` made inside the block.

    Holds :data:`ENVIRON_LOCK` throughout: the snapshot and the restore must
    not interleave with another thread's changes.
    """
    with ENVIRON_LOCK:
        before = dict(os.environ)
        try:
            yield
        finally:
            for key in [k for k in os.environ if k not in before]:
                os.environ.pop(key, None)
            for key, value in before.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value


#: L3 deadlines of the CPU harness (seconds): generous, since its machines
#: run many processes on two cores (a test of a deadline names its own).
HARNESS_DEADLINES = {"prefetch_timeout_base": 60.0, "prefetch_timeout_max": 120.0}


def with_harness_deadlines(extra_config: str | None) -> str:
    """``--hicache-storage-backend-extra-config`` JSON with
    :data:`HARNESS_DEADLINES` where it names no deadline of its own."""
    extra = json.loads(extra_config) if extra_config else {}
    for key, value in HARNESS_DEADLINES.items():
        extra.setdefault(key, value)
    return json.dumps(extra)


def make_cpu_server_args(
    *,
    page_size: int = DSA_PAGE_SIZE,
    hicache_mem_layout: str = "layer_first",
    hicache_io_backend: str = "kernel",
    hicache_ratio: float = 2.0,
    hicache_size: int = 0,
    hicache_write_policy: str = "write_through",
    model_path: str | None = None,
    keep_env_changes: bool = False,
    **overrides: Any,
) -> ServerArgs:
    """``ServerArgs`` for a CPU HiCache with the given host-pool settings.

    ``model_path`` defaults to :func:`tiny_model_dir`. Unless
    ``keep_env_changes``, environment variables ``ServerArgs.__post_init__``
    sets (``SGLANG_USE_CUDA_IPC_TRANSPORT``, ``SGLANG_ENABLE_TORCH_COMPILE``,
    ...) are restored afterwards. Safe to call from several threads at once:
    the construction holds :data:`ENVIRON_LOCK`. Note that ServerArgs rewrites two layout/io
    combinations: ``page_first_direct`` + ``kernel`` becomes ``direct`` io and
    ``page_first`` + ``direct`` becomes ``page_first_direct``; read the
    result's fields rather than the arguments.
    """
    from sglang.srt.server_args import ServerArgs

    kwargs: dict[str, Any] = dict(
        model_path=model_path if model_path is not None else tiny_model_dir(),
        device="cpu",
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_mem_layout=hicache_mem_layout,
        hicache_io_backend=hicache_io_backend,
        hicache_ratio=hicache_ratio,
        hicache_size=hicache_size,
        hicache_write_policy=hicache_write_policy,
    )
    kwargs.update(overrides)
    env = contextlib.nullcontext() if keep_env_changes else preserved_environ()
    # ServerArgs.__post_init__ sets variables and runs subprocesses: one at a time.
    with ENVIRON_LOCK, env:
        return ServerArgs(**kwargs)


def publish_server_args(server_args: ServerArgs, *, role: str = "scheduler") -> RuntimeContext:
    """Publish ``server_args`` as this process's runtime context.

    Process-global and last-publish-wins: publish before constructing each
    ``HiRadixCache`` whose settings differ (``get_memory().hicache_ratio`` is
    read in its ``__init__`` only).
    """
    from sglang.srt import runtime_context

    return runtime_context.publish(server_args, role=role)


def make_local_gloo_group() -> dist.ProcessGroup:
    """A gloo process group holding only this process (rank 0 of 1).

    Built directly on an in-memory ``HashStore``: no default process group,
    no port, no environment variable. ``torch.distributed.get_world_size``,
    ``all_reduce`` and ``barrier`` accept it whether or not a default group
    exists (checked with a 2-process default group on torch 2.13). With
    world size 1, HiRadixCache skips every consensus ``all_reduce``.
    """
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
