"""The seams of the real-scheduler harness, listed and checked (both releases).

The harness runs SGLang's own ``Scheduler`` and event loops on CPU; only the
things below are replaced. Each :class:`Seam` names the SGLang source it
stands in for and the SGLang names it depends on (as hook-registry
:class:`~sglang_cp_hicache.hook_registry.Hook` entries). :func:`check_seams`
resolves them all in the installed release before a rank builds its
scheduler, so a release that moved or renamed one fails at start-up naming
the seam, not in the middle of a scenario with a stale stand-in.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

from sglang_cp_hicache.hook_registry import Hook, HookMismatchError, attribute_hooks, check_hooks

__all__ = ["SEAMS", "Seam", "SeamMismatchError", "check_seams", "import_only_stand_ins", "seams_for"]

_SCHED = "sglang.srt.managers.scheduler"
_WORKER = "sglang.srt.managers.tp_worker"
_PREFILL = "sglang.srt.disaggregation.prefill"
_WORKER_WHY = "is called by the scheduler on the stand-in worker, which mirrors TpModelWorker's interface"


@dataclass(frozen=True)
class Seam:
    """One thing the harness replaces.

    ``stands_in_for``: the SGLang source (``file:function``) whose behaviour
    the seam replaces; ``hooks``: the SGLang names it relies on; ``releases``:
    where it applies.
    """

    name: str
    stands_in_for: str
    why: str
    hooks: tuple[Hook, ...]
    releases: tuple[str, ...] = ("0.5.18", "0.5.23")


class SeamMismatchError(RuntimeError):
    """The installed SGLang moved or changed what a harness seam replaces."""

    def __init__(self, seam: Seam, cause: HookMismatchError) -> None:
        self.seam = seam
        super().__init__(
            f"sglang-cp-hicache scheduler harness: seam {seam.name!r} (stands in for {seam.stands_in_for}) "
            f"no longer matches the installed SGLang: {cause}"
        )


def _worker_methods(version: str) -> tuple[Hook, ...]:
    names = "get_memory_pool init_attention_backends init_cuda_graphs register_hicache_layer_transfer_counter"
    names += " set_hicache_consumer get_pad_input_ids_func get_worker_info model_runner alloc_memory_pool"
    hooks = attribute_hooks(_WORKER, "TpModelWorker", names, _WORKER_WHY)
    # the stand-in's forward is called as forward_batch_generation(batch, **kwargs)
    return hooks + (Hook(_WORKER, "TpModelWorker", "forward_batch_generation", "attribute", None, _WORKER_WHY),)


SEAMS: tuple[Seam, ...] = (
    Seam(
        "model-worker",
        "sglang/srt/managers/scheduler.py:Scheduler.init_tp_model_worker (TpModelWorker + ModelRunner)",
        "the harness subclass builds a stand-in worker whose runner holds the real pools and whose forward "
        "writes and checks content keys, as SGLang's MLX backend runs its scheduler over a stub runner",
        (Hook(_SCHED, "Scheduler", "init_tp_model_worker", "override", ("self",), "is the one model-worker seam"),
         Hook(_SCHED, "Scheduler", "run_event_loop", "call", ("self",), "is the loop every scenario runs"),
         Hook(_SCHED, "Scheduler", "gracefully_exit", "attribute", None, "ends the loop on a ShutdownReq")),
    ),
    Seam(
        "worker-interface",
        "sglang/srt/managers/tp_worker.py:TpModelWorker",
        "the stand-in implements the methods the scheduler calls on TpModelWorker; a renamed one would "
        "leave the stand-in's copy unused",
        (),
    ),
    Seam(
        "dsa-model",
        "sglang/srt/mem_cache/kv_cache_builder.py:is_deepseek_dsa",
        "a DeepSeek-V3.2 config resolves server args with torch.cuda.get_device_capability(); the harness "
        "runs a llama config and tells the tree-cache builder the model is DSA",
        (Hook("sglang.srt.mem_cache.kv_cache_builder", None, "is_deepseek_dsa", "replaced-on-instance", ("config",),
              "decides the DSA tree cache / host pools"),),
    ),
    Seam(
        "pd-transfer",
        "sglang/srt/disaggregation/prefill.py: get_kv_class (MANAGER / SENDER / KVARGS lookups)",
        "'fake' is refused for a prefill server and 'mooncake' starts a transfer engine; the harness asks "
        "for 'nixl' and maps the prefill module's class lookups to SGLang's FAKE classes (the sender scripted)",
        (Hook(_PREFILL, None, "get_kv_class", "replaced-on-instance", ("transfer_backend", "class_type"),
              "maps PD transfer classes"),
         Hook("sglang.srt.disaggregation.utils", "TransferBackend", "FAKE", "attribute", None, "names the fake classes"),
         Hook("sglang.srt.disaggregation.fake", None, "FakeKVSender", "attribute", None, "is the scripted sender's base")),
    ),
    Seam(
        "pd-overlap-event",
        "sglang/srt/disaggregation/prefill.py:SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk "
        "(torch.cuda.Event)",
        "the PD overlap loop records a CUDA event unconditionally; CPU streams are synchronous, a CPU event stands in",
        (Hook(_PREFILL, "SchedulerDisaggregationPrefillMixin", "maybe_send_cached_prefix_chunk", "attribute", None,
              "makes the event"),),
    ),
    Seam(
        "pd-prefill-shutdown",
        "sglang/srt/disaggregation/prefill.py:SchedulerDisaggregationPrefillMixin.event_loop_normal_disagg_prefill / "
        "event_loop_overlap_disagg_prefill (0.5.18: no gracefully_exit check)",
        "a loop still running one idle iteration after the ShutdownReq is ended from on_idle, on every rank at once "
        "(the request reached them all on one iteration); the result says so",
        (Hook(_PREFILL, "SchedulerDisaggregationPrefillMixin", "event_loop_normal_disagg_prefill", "attribute", None,
              "runs PD prefill"),
         Hook(_PREFILL, "SchedulerDisaggregationPrefillMixin", "event_loop_overlap_disagg_prefill", "attribute",
              None, "runs PD prefill with overlap"),
         Hook(_SCHED, "Scheduler", "on_idle", "replaced-on-instance", ("self",), "is where the harness observes")),
    ),
    Seam(
        "repeatable-intake",
        "sglang/srt/managers/scheduler_components/request_receiver.py: sock_recv (rank 0's non-blocking drain of "
        "the input socket); Scheduler.process_input_requests",
        "rank 0 waits for every message the parent says it pushed before reporting the socket empty, and every "
        "rank counts what it processed, so zmq's delivery time never decides a batch",
        (Hook("sglang.srt.managers.scheduler_components.request_receiver", None, "sock_recv", "attribute", None,
              "is the drain of the input socket"),
         Hook(_SCHED, "Scheduler", "process_input_requests", "replaced-on-instance", ("self", "recv_reqs"),
              "is where every rank's loop takes its input")),
    ),
    Seam(
        "lru-ties",
        "sglang/srt/mem_cache/radix_cache.py: TreeNode.__hash__ (object identity)",
        "SGLang's eviction heap starts from a set of nodes, so LRU ties leave in memory-address order; hashing a "
        "node by its creation counter (TreeNode.id) breaks them by creation order instead",
        (Hook("sglang.srt.mem_cache.radix_cache", None, "TreeNode", "attribute", None, "is the radix node"),),
    ),
    Seam(
        "idle-report",
        "sglang/srt/managers/scheduler.py: Scheduler.maybe_sleep_on_idle (the last step of on_idle)",
        "the rank's idle snapshot goes out before SGLang's idle sleep (up to a second on rank 0), once the idle "
        "leak checks before it passed",
        (Hook(_SCHED, "Scheduler", "maybe_sleep_on_idle", "replaced-on-instance", ("self",),
              "sleeps after on_idle's checks"),),
    ),
    Seam(
        "forced-retraction",
        "sglang/srt/managers/scheduler.py: TEST_RETRACT, TEST_RETRACT_INTERVAL (SGLANG_TEST_RETRACT*, read at import)",
        "SGLang's own retraction test switch; the zygote imported the scheduler before a rank knew its config, so a "
        "run that asks for forced retraction sets the module's two values",
        (Hook(_SCHED, None, "TEST_RETRACT", "attribute", None, "makes a decode batch retract every interval"),
         Hook(_SCHED, None, "TEST_RETRACT_INTERVAL", "attribute", None, "is that interval")),
    ),
    Seam(
        "uvloop",
        "sglang/srt/managers/tokenizer_manager.py: import uvloop (reached from mm_utils on the recv path)",
        "an import-only module whose EventLoopPolicy is asyncio's default; the tokenizer manager never runs",
        (),
        releases=("0.5.18",),
    ),
    Seam(
        "web-stack-imports",
        "sglang/srt/managers/scheduler.py imports (setproctitle, einops, uvicorn, fastapi)",
        "import-only modules where the package is not installed; nothing the scheduler loop calls uses them",
        (),
    ),
    Seam(
        "environment",
        "sglang/srt/environ.py: SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND, "
        "SGLANG_CPU_OMP_THREADS_BIND",
        "strict idle leak checks raise; 0.5.23's python radix core (the library subclasses it); CPU thread binding "
        "for CP > 1",
        (Hook("sglang.srt.environ", "Envs", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "attribute", None,
              "makes SGLang's idle leak checks raise"),),
    ),
)

_RELEASE_HOOKS: dict[str, tuple[Hook, ...]] = {
    "0.5.23": (Hook("sglang.srt.environ", "Envs", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "attribute", None,
                    "selects the python radix core"),),
    "0.5.18": (Hook("sglang.srt.managers.tokenizer_manager", None, "uvloop", "attribute", None,
                    "is imported at module level"),),
}


def seams_for(version: str) -> tuple[Seam, ...]:
    """The seams of ``version`` with their release-specific hooks filled in."""
    if version not in ("0.5.18", "0.5.23"):
        raise ValueError(f"version must be '0.5.18' or '0.5.23', got {version!r}")
    out = []
    for seam in SEAMS:
        if version not in seam.releases:
            continue
        hooks = seam.hooks
        if seam.name == "worker-interface":
            hooks = _worker_methods(version)
        elif seam.name == "environment":
            hooks = hooks + tuple(h for h in _RELEASE_HOOKS[version] if "environ" in h.module)
        elif seam.name == "uvloop":
            hooks = tuple(h for h in _RELEASE_HOOKS[version] if h.attribute == "uvloop")
        out.append(Seam(seam.name, seam.stands_in_for, seam.why, hooks, seam.releases))
    return tuple(out)


def check_seams(version: str) -> None:
    """Raise :class:`SeamMismatchError` naming the first seam whose SGLang names moved."""
    import_only_stand_ins(version)
    for seam in seams_for(version):
        try:
            check_hooks(seam.hooks, version, "update the scheduler harness seam")
        except HookMismatchError as exc:
            raise SeamMismatchError(seam, exc) from None


_IMPORT_ONLY = (("setproctitle", ()), ("einops", ()), ("uvicorn", ()), ("fastapi", ("responses",)))


class _Anything:
    """Whatever a module-level use asks of it: constructed, called, used as a decorator."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def _stand_in_attribute(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Anything,), {})


def import_only_stand_ins(version: str) -> None:
    """Install the import-only modules (only those not installed); idempotent."""
    for top, subs in _IMPORT_ONLY:
        if top in sys.modules or importlib.util.find_spec(top) is not None:
            continue
        for name in (top, *(f"{top}.{sub}" for sub in subs)):
            stub = types.ModuleType(name)
            stub.__path__ = []  # type: ignore[attr-defined]
            stub.__getattr__ = _stand_in_attribute  # type: ignore[method-assign]
            sys.modules[name] = stub
    if version == "0.5.18" and "uvloop" not in sys.modules and importlib.util.find_spec("uvloop") is None:
        import asyncio

        uv = types.ModuleType("uvloop")
        uv.EventLoopPolicy = asyncio.DefaultEventLoopPolicy  # type: ignore[attr-defined]
        sys.modules["uvloop"] = uv
