"""One CP rank of the real-scheduler harness: SGLang's ``Scheduler`` and its
own ``run_event_loop`` in a process forked from the harness's zygote.

The rank builds the scheduler as ``run_scheduler_process`` does (publish the
runtime context, ``load_plugins()``, construct), with the seams of
:mod:`.sched_seams` applied and checked first, and talks to the parent over
one duplex pipe: a :class:`~.sched_forward.BatchReport` before every forward
(the parent answers ``"go"`` once every rank reported the same batch and the
scenario acted), and at the end one :class:`RankResult` or
:class:`RankError`. Requests, aborts and the ShutdownReq that ends the loop
come through the real input socket, not the pipe.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from sglang_cp_hicache.testing.lifetime import die_with_launcher
from sglang_cp_hicache.testing.patching import PatchSet
from sglang_cp_hicache.testing.sched_config import IpcNames, SchedConfig, server_args_kwargs
from sglang_cp_hicache.testing.sched_forward import BatchReport, ForwardStats
from sglang_cp_hicache.testing.sched_intake import Intake, install_intake
from sglang_cp_hicache.testing.sched_l3 import final_l3, l3_counters, record_l3_keys
from sglang_cp_hicache.testing.sched_seams import check_seams, import_only_stand_ins

__all__ = ["LoadBack", "RankError", "RankReady", "RankResult", "RankSpec", "forked_rank_main", "preload"]


@dataclass(frozen=True)
class RankSpec:
    config: SchedConfig
    rank: int
    ipc: IpcNames
    log_path: str


@dataclass(frozen=True)
class RankReady:
    rank: int
    tree_cache: str
    allocator: str
    library: bool  # the library's CP cache serves this rank (0.5.18 backend / 0.5.23 copy strategy)
    build_seconds: float
    optimistic_prefill_attempts: int  # as SGLang resolved it (it turns optimistic prefill off in some setups)


@dataclass(frozen=True)
class LoadBack:
    rid: str
    host_hit_tokens: int
    loaded_tokens: int
    # Batches this rank had forwarded when the load-back ran: the step of the
    # batch it was for. SGLang loads back before its last admission checks,
    # so a request can be turned away after its load-back; the pages loaded
    # for it are then unlocked and may be evicted before it runs.
    step: int = -1


@dataclass
class RankResult:
    """A rank's state; sent once per idle period (after SGLang's own idle
    leak checks passed in ``on_idle``: strict mode raises on a leak) and at the end."""

    rank: int
    stats: ForwardStats
    load_backs: list[LoadBack] = field(default_factory=list)
    idle_checks: int = 0  # on_idle calls made while fully idle, each one passed
    counters: dict[str, int] = field(default_factory=dict)  # the library's cp_counters, where the cache has them
    l3_counters: dict[str, int] = field(default_factory=dict)  # the library's L3 counters, where L3 is on
    free_device_tokens: int = 0
    evictable_tokens: int = 0
    final: bool = False  # the result after the loop ended
    loops: list[str] = field(default_factory=list)  # the event loops SGLang's run_event_loop dispatched to
    loop_ignored_shutdown: bool = False  # the loop ran on past a ShutdownReq; the harness ended it
    processed: int = 0  # input-socket messages the loop had processed
    # The final result only (the lists grow with the run): the page keys of the own pages this rank's L3
    # stored and restored, its failed page reads, its L3 I/O totals (bytes of pages stored or found sound,
    # bytes read) and the bytes of one own page (KV and indexer objects)
    l3_stored_keys: list[str] = field(default_factory=list)
    l3_restored_keys: list[str] = field(default_factory=list)
    l3_read_failures: int = 0
    l3_io: dict[str, float] = field(default_factory=dict)
    l3_page_bytes: int = 0


@dataclass(frozen=True)
class RankError:
    rank: int
    error: str
    traceback: str


class _LoopIgnoredShutdown(Exception):
    """Raised from on_idle to end an event loop that ignores ``gracefully_exit``."""


def preload(version: str) -> None:
    """What the zygote imports once for every rank: torch, SGLang's scheduler
    and the seams' targets. Starts no thread, runs no torch op."""
    import warnings

    import torch  # noqa: F401

    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_sglang_importable()
    import_only_stand_ins(version)
    import sglang.srt.disaggregation.prefill  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401

    check_seams(version)


def _install_cpu_support(version: str) -> None:
    if version == "0.5.23":
        from sglang_cp_hicache.testing import cpu_0523

        cpu_0523.install_cpu_support()
    else:
        from sglang_cp_hicache.testing import cpu_support

        cpu_support.install_cpu_support()


def _environment(config: SchedConfig) -> None:
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"  # a leak raises in on_idle
    # the run's L3 is the config's alone: these would switch one on without it, or move it elsewhere
    for name in ("SGLANG_CP_HICACHE_L3_DIR", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        os.environ.pop(name, None)
    if config.version == "0.5.23":
        os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
        os.environ["SGLANG_CP_HICACHE_COPY"] = config.copy_path
    if config.cp_size > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(["0"] * config.cp_size)


def _seam_patches(config: SchedConfig) -> PatchSet:
    import torch
    from sglang.srt.disaggregation import prefill
    from sglang.srt.managers import scheduler
    from sglang.srt.mem_cache import kv_cache_builder, radix_cache

    from sglang_cp_hicache.testing.sched_pd import scripted_kv_class

    patches = PatchSet()
    plan: list = [(kv_cache_builder, "is_deepseek_dsa", lambda _orig: (lambda config: True)),
                  # SGLang builds its LRU eviction heap from a set of nodes, so leaves accessed at the same
                  # instant leave in set order, i.e. by memory address: a run-to-run difference. Hashing a
                  # node by its creation counter breaks them by creation order instead (LRU unchanged).
                  (radix_cache.TreeNode, "__hash__", lambda _orig: _node_hash)]
    if config.pd_prefill:
        plan.append((prefill, "get_kv_class", lambda _orig: scripted_kv_class(config)))
        if config.overlap:
            plan.append((torch.cuda, "Event", lambda _orig: torch.cpu.Event))
    if config.forced_retract_interval:
        plan += [(scheduler, "TEST_RETRACT", lambda _orig: True),
                 (scheduler, "TEST_RETRACT_INTERVAL", lambda _orig: config.forced_retract_interval)]
    with patches.lock:
        patches.apply(plan)
    return patches


def _node_hash(node: Any) -> int:
    return hash(node.id)


def _build(spec: RankSpec, channel: Any, intake: Intake) -> Any:
    from sglang.srt import runtime_context
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import PortArgs, ServerArgs

    from sglang_cp_hicache.testing.sched_worker import StandInTpWorker

    config = spec.config
    server_args = ServerArgs(**server_args_kwargs(config), nccl_port=spec.ipc.nccl_port)
    fields = {name: getattr(spec.ipc, name) for name in IpcNames.__dataclass_fields__}
    port_args = PortArgs(**fields, tokenizer_worker_ipc_name=None, decoupled_spec_ipc_config=None)
    load_plugins()  # as run_scheduler_process does: the library registers its backend / pools here
    if config.version == "0.5.23":
        from sglang.srt.runtime_context import SpawnRanks

        runtime_context.publish(server_args, role="scheduler",
                                ranks=SpawnRanks(world_rank=spec.rank, dp_rank=None, gpu_id=spec.rank))
    else:
        runtime_context.publish(server_args, role="scheduler")
    _seam_patches(config)

    def gate(report: BatchReport) -> None:
        channel.send(report)
        answer = channel.recv()
        while intake.take(answer):  # the parent's count of what it pushed while this batch waited
            answer = channel.recv()
        if answer != "go":
            raise RuntimeError(f"rank {spec.rank}: the parent answered {answer!r} to batch {report.step}")

    class HarnessScheduler(Scheduler):  # type: ignore[misc, valid-type]
        def init_tp_model_worker(self) -> None:  # the model-worker seam
            self.tp_worker = StandInTpWorker(config.version, self, config.shape, gate, spec.rank)

    if config.version == "0.5.23":
        scheduler = HarnessScheduler(server_args, port_args)
        from sglang_cp_hicache.testing import cpu_0523

        cpu_0523.register_stack_buffers(scheduler.tree_cache.cache_controller.mem_pool_host)
    else:
        scheduler = HarnessScheduler(server_args, port_args, gpu_id=spec.rank, tp_rank=spec.rank, moe_ep_rank=0,
                                     pp_rank=0, attn_cp_rank=spec.rank, moe_dp_rank=0, dp_rank=None)
    scheduler.tp_worker.forward.scheduler = scheduler
    if config.trap_insert_reads:
        from sglang_cp_hicache.testing.sched_trap import install_insert_trap

        install_insert_trap(scheduler)
    return scheduler


def _snapshot(scheduler: Any, result: RankResult, intake: Intake) -> RankResult:
    result.processed = intake.processed
    result.free_device_tokens = int(scheduler.token_to_kv_pool_allocator.available_size())
    result.evictable_tokens = int(scheduler.tree_cache.evictable_size())
    counters = getattr(scheduler.tree_cache, "cp_counters", None)
    if counters is not None:
        result.counters = {k: int(v) for k, v in vars(counters).items() if isinstance(v, int)}
    l3 = l3_counters(scheduler.tree_cache)
    if l3 is not None:
        result.l3_counters = {k: int(v) for k, v in vars(l3).items() if isinstance(v, int)}
    return result


def _observe(scheduler: Any, result: RankResult, channel: Any, intake: Intake) -> Any:
    """Record each load-back the scheduler asks for; after each fully idle
    ``on_idle`` following a batch or new input, send the parent a snapshot."""
    cache = scheduler.tree_cache
    forward = scheduler.tp_worker.forward
    init_load_back = cache.init_load_back

    def observed_load_back(params: Any, *args: Any, **kwargs: Any) -> Any:
        out = init_load_back(params, *args, **kwargs)
        if out is None:  # 0.5.23: admission retries later, nothing committed
            return out
        first = out[0] if isinstance(out, tuple) else out
        loaded = first if isinstance(first, int) else int(getattr(first, "numel", lambda: 0)())
        rid = str(getattr(params.req, "rid", ""))
        result.load_backs.append(LoadBack(rid, int(params.host_hit_length), loaded, result.stats.batches))
        forward.host_loaded[rid] = forward.host_loaded.get(rid, 0) + loaded  # the L3 tail it can hold
        return out

    cache.init_load_back = observed_load_back
    on_idle = scheduler.on_idle

    reported_at = [(-1, -1)]  # (batches, processed inputs) at the last idle snapshot
    checked = [False]  # this on_idle call found the rank fully idle: its leak checks run before its sleep

    def passed() -> None:
        checked[0] = False
        result.idle_checks += 1
        if reported_at[0] != (result.stats.batches, intake.processed):
            reported_at[0] = (result.stats.batches, intake.processed)
            channel.send(_snapshot(scheduler, result, intake))

    exit_idles = [0]  # on_idle calls since a ShutdownReq set gracefully_exit

    def observed_on_idle() -> None:
        if scheduler.gracefully_exit:
            exit_idles[0] += 1
            # a loop honouring gracefully_exit leaves at its next iteration's top, after at most this one
            # on_idle; SGLang 0.5.18's PD prefill loops never look at it: the harness ends those itself
            # (every rank got the ShutdownReq on the same iteration, so all stop on the same one)
            if exit_idles[0] > 1 and scheduler.is_fully_idle():
                result.loop_ignored_shutdown = True
                raise _LoopIgnoredShutdown()
        checked[0] = scheduler.is_fully_idle()
        on_idle()
        if checked[0]:  # on_idle returned without reaching its sleep
            passed()

    sleep = scheduler.maybe_sleep_on_idle

    def report_then_sleep() -> None:
        # SGLang sleeps last in on_idle, after its leak checks passed: the snapshot goes out before the
        # sleep (up to a second on the rank that polls the input socket), not after it
        if checked[0]:
            passed()
        sleep()

    scheduler.maybe_sleep_on_idle = report_then_sleep
    scheduler.on_idle = observed_on_idle
    for name in _LOOPS:
        _record_loop(scheduler, name, result)
    return on_idle


_LOOPS = ("event_loop_normal", "event_loop_overlap", "event_loop_normal_disagg_prefill",
          "event_loop_overlap_disagg_prefill")


def _record_loop(scheduler: Any, name: str, result: RankResult) -> None:
    loop = getattr(scheduler, name)

    def recorded() -> None:
        result.loops.append(name)
        loop()

    setattr(scheduler, name, recorded)


def _final_idle_check(scheduler: Any, on_idle: Any, result: RankResult, intake: Intake) -> None:
    """The loop ended on the ShutdownReq: the rank must be fully idle, and
    SGLang's own idle leak checks must pass once more (no sleep)."""
    if not scheduler.is_fully_idle():
        raise AssertionError(
            f"not fully idle at shutdown: waiting={[r.rid for r in scheduler.waiting_queue]} "
            f"running={[r.rid for r in scheduler.running_batch.reqs]} chunked={scheduler.chunked_req}")
    scheduler.idle_sleeper = None
    on_idle()  # SGLang's own, not the observed one
    _snapshot(scheduler, result, intake)
    result.final = True


def _library_active(version: str, scheduler: Any) -> bool:
    if version == "0.5.23":
        from sglang_cp_hicache.sglang_0523.controller import library_stack

        return library_stack(scheduler.tree_cache) is not None
    from sglang_cp_hicache.sglang_0518.hiradix import CpHiRadixCache

    return isinstance(scheduler.tree_cache, CpHiRadixCache)


def forked_rank_main(spec: RankSpec, channel: Any, zygote_pid: int) -> None:
    """The zygote's target: build, run SGLang's event loop, report; never returns."""
    die_with_launcher(zygote_pid)
    log = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # the parent asks for every thread's stack before it fails a stalled run
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 1
    try:
        start = time.perf_counter()
        import torch

        torch.set_num_threads(1)  # CP ranks share the machine's cores: no oversubscription
        _environment(spec.config)
        _install_cpu_support(spec.config.version)
        check_seams(spec.config.version)
        intake = Intake()
        scheduler = _build(spec, channel, intake)
        install_intake(scheduler, spec.rank, channel, intake)
        result = RankResult(spec.rank, scheduler.tp_worker.forward.stats)
        on_idle = _observe(scheduler, result, channel, intake)
        keys = record_l3_keys(scheduler.tree_cache)
        channel.send(RankReady(spec.rank, type(scheduler.tree_cache).__name__,
                               type(scheduler.token_to_kv_pool_allocator).__name__,
                               _library_active(spec.config.version, scheduler), time.perf_counter() - start,
                               int(getattr(scheduler.server_args, "optimistic_prefill_attempts", 0) or 0)))
        try:
            scheduler.run_event_loop()  # SGLang's own loop; a ShutdownReq through the input socket ends it
        except _LoopIgnoredShutdown:
            pass
        _final_idle_check(scheduler, on_idle, result, intake)
        final_l3(scheduler.tree_cache, result, keys)
        channel.send(result)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the rank exits non-zero
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        try:
            channel.send(RankError(spec.rank, f"{type(exc).__name__}: {exc}", text))
        except (OSError, ValueError):
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # leave without interpreter teardown: gloo can abort while its group is destroyed in arbitrary order
        os._exit(code)

