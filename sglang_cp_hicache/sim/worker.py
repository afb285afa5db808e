"""Body of one simulator process: a CP rank on a gloo group, or the non-CP run.

The process ties its life to the launcher's first (:mod:`.lifetime`), writes
its own stdout/stderr (SGLang import chatter, warnings, tracebacks) to the
log file the launcher handed it, and talks to the launcher only through its
own pipe: :class:`Progress`, then one :class:`RankReport` or
:class:`RankFailure`. SGLang is imported here, in the child, through the
adapter and the CPU harness.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, Optional

from sglang_cp_hicache import settings
from sglang_cp_hicache.sim.config import FAIL_ENV, FailureInjection, RankSpec
from sglang_cp_hicache.sim.fleet.feed import RankFeed
from sglang_cp_hicache.testing.lifetime import EXIT_LAUNCHER_GONE, die_with_launcher
from sglang_cp_hicache.sim.metrics_scrape import scrape_library_metrics
from sglang_cp_hicache.sim.records import (
    AFTER_REPLAY,
    Progress,
    RankFailure,
    RankReport,
    RequestRecord,
    StartupEvent,
)

__all__ = ["forked_rank_main", "preload_release", "rank_main"]


class InjectedFailure(RuntimeError):
    pass


def _redirect_output(fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _send(channel: Any, message: object) -> None:
    """Send to the launcher; if it is gone (broken pipe) there is nobody to
    report to: exit at once."""
    try:
        channel.send(message)
    except OSError:
        os._exit(EXIT_LAUNCHER_GONE)


def _inject(failure: FailureInjection, engine: Any = None) -> None:
    """Act out the test hook (see FAIL_ENV)."""
    if failure.mode == "hang":
        while True:  # stop answering collectives; the launcher must end this
            time.sleep(1.0)
    elif failure.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif failure.mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif failure.mode == "corrupt":
        engine.corrupt_next_restore = True
    else:
        where = "startup" if failure.step is None else failure.step
        raise InjectedFailure(f"injected failure ({FAIL_ENV}={failure.rank}:{where})")


def _set_collective_timeout(seconds: float) -> None:
    """Shorten the default group's timeout once every rank is up. Uses
    torch's private ``_set_pg_timeout`` (present in torch 2.13); without it
    the startup timeout stays in force, which is still bounded."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timedelta(seconds=seconds))
    else:
        print("torch.distributed has no _set_pg_timeout: keeping the startup timeout", file=sys.stderr)


def _agreement(engine_digest: str, acks: tuple, cp_size: int) -> dict[str, Any]:
    """all_gather every rank's tree digest and ack counts; identical on all ranks."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * cp_size
    dist.all_gather_object(gathered, (engine_digest, acks))
    return _agreement_of(gathered)


def _agreement_of(gathered: list[Any]) -> dict[str, Any]:
    """The verdict over every rank's (tree digest, ack counts)."""
    digests = [g[0] for g in gathered]
    ack_rows = [list(g[1]) for g in gathered]
    return {
        "tree_digests": digests,
        "acks": ack_rows,
        "digests_agree": len(set(digests)) == 1,
        "acks_agree": all(row == ack_rows[0] for row in ack_rows),
    }


#: The KV rows of both releases' stacks: DeepSeek-V3.2's raw FP8 rows (576
#: bytes: kv_lora_rank 512 + rope 64, one byte each), as SGLang 0.5.23's KV
#: sharding requires; the same row format on both releases, so one L3
#: directory serves both.
KV_DTYPE = "float8_e4m3fn"


@dataclass
class _RankSetup:
    """A started rank: its group (None without one), stack and engine."""

    world: int  # processes in the group
    group_rank: int
    group: Any
    stack: Any
    engine: Any
    startup_seconds: float


def _mooncake_storage(cfg: Any, *, segment_ranks: int) -> dict[str, Any]:
    """The stack's --hicache-storage-backend mooncake and extra config for
    --l3 mooncake://... (nothing otherwise). ``segment_ranks``: the TP size
    the stack's server arguments carry (0.5.18's CPU stack: 1; 0.5.23's
    sharded one: the CP size), which SGLang divides the global segment by."""
    if cfg.l3_mooncake is None:
        return {}
    from sglang_cp_hicache.sim.mooncake_l3 import extra_config

    return {"storage_backend": "mooncake",
            "storage_extra_config": extra_config(cfg.l3_mooncake, cfg.mooncake_segment_bytes, segment_ranks)}


def _build_0518(spec: RankSpec, group: Any) -> tuple[Any, Any]:
    """One rank's SGLang 0.5.18 stack (CP, or a non-CP baseline process) and its engine."""
    import torch

    from sglang_cp_hicache.sim.engine_0518 import SimRankEngine
    from sglang_cp_hicache.testing.stack_0518 import CpStackConfig, build_cp_rank_stack

    cfg = spec.config
    # Set before the cache is built, which reads it; empty (off) for the
    # non-CP baseline and without --l3, whatever the launcher's environment says.
    l3_dir = cfg.l3_dir if spec.cp_mode and cfg.l3_dir is not None else ""
    os.environ[settings.L3_DIR.name] = l3_dir
    if spec.cp_mode:
        stack_config = CpStackConfig(
            cp_size=cfg.cp_size, page_size=cfg.page_size, num_layers=cfg.num_layers,
            device_pages=cfg.device_pages, host_pages=cfg.host_pages, cp_mode=True, dtype=getattr(torch, KV_DTYPE),
            enable_metrics=cfg.metrics, **_mooncake_storage(cfg, segment_ranks=1),
        )
        rank = spec.rank
    else:
        # The same logical capacity in every non-CP process (a TP rank of an MLA
        # model holds the whole KV pool): the CP pool has device_pages * cp_size
        # logical pages with page 0 as padding; the plain allocator adds its
        # padding page on top, hence the -1.
        stack_config = CpStackConfig(
            cp_size=1, page_size=cfg.page_size, num_layers=cfg.num_layers,
            device_pages=cfg.logical_device_pages - 1, host_pages=cfg.host_pages * cfg.cp_size,
            cp_mode=False, dtype=getattr(torch, KV_DTYPE),
        )
        rank = 0
    stack = build_cp_rank_stack(stack_config, rank, cp_group=group)
    engine = SimRankEngine(stack, content_seed=cfg.seed)
    return stack, engine


def _build_0523(spec: RankSpec, group: Any) -> tuple[Any, Any]:
    """One CP rank's SGLang 0.5.23 KV-sharded stack and its engine, or a
    process of the non-CP baseline: a plain stack with N x the device and
    host pages of a CP rank (the CP run's logical capacity)."""
    from sglang_cp_hicache.sim.engine_0523 import ShardedSimRankEngine
    from sglang_cp_hicache.testing.stack_0523 import ShardedStackConfig, build_sharded_rank_stack

    cfg = spec.config
    if not spec.cp_mode:
        return _build_0523_plain(spec, group)
    # Read when the library strategy builds the stack (upstream's copy path
    # has no L3); empty (off) without --l3, whatever the launcher's environment says.
    os.environ[settings.L3_DIR.name] = cfg.l3_dir if cfg.l3_dir is not None else ""
    stack = build_sharded_rank_stack(
        ShardedStackConfig(
            cp_size=cfg.cp_size, page_size=cfg.page_size, num_layers=cfg.num_layers,
            device_pages=cfg.device_pages, host_pages=cfg.host_pages, copy_path=cfg.copy_path,
            enable_metrics=cfg.metrics, **_mooncake_storage(cfg, segment_ranks=cfg.cp_size),
        ),
        spec.rank, cp_group=group,
    )
    return stack, ShardedSimRankEngine(stack, content_seed=cfg.seed)


def _build_0523_plain(spec: RankSpec, group: Any) -> tuple[Any, Any]:
    from sglang_cp_hicache.sim.engine_0523_plain import PlainSimRankEngine
    from sglang_cp_hicache.testing.stack_0523 import PlainStackConfig, build_plain_rank_stack

    cfg = spec.config
    os.environ[settings.L3_DIR.name] = ""  # the baseline runs without L3
    stack = build_plain_rank_stack(
        PlainStackConfig(
            page_size=cfg.page_size, num_layers=cfg.num_layers,
            device_pages=cfg.non_cp_device_pages, host_pages=cfg.host_pages * cfg.cp_size,
        ),
        tp_rank=-1 - spec.rank, tp_group=group,
    )
    return stack, PlainSimRankEngine(stack, content_seed=cfg.seed)


def _join_group(spec: RankSpec, world: int, group_rank: int) -> Any:
    """The gloo group of this run's processes (None for a lone process)."""
    if world <= 1:
        return None
    import torch.distributed as dist

    cfg = spec.config
    # Rendezvous and stack build wait for the slowest `import sglang` (seconds
    # per process, more on a loaded machine): the startup timeout, then the
    # collective timeout for the replay (see _start_rank).
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec.master_port}",
        rank=group_rank,
        world_size=world,
        timeout=timedelta(seconds=max(cfg.collective_timeout_s, cfg.startup_limit_s)),
    )
    return dist.group.WORLD


def _start_rank(spec: RankSpec, channel: Any) -> _RankSetup:
    """Import SGLang, join the group, build the stack (telling the launcher
    as each is done); the copy counters start from zero afterwards, so they
    count the replay only."""
    import torch

    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    started = time.perf_counter()
    torch.set_num_threads(1)  # ranks share the machine's cores; no oversubscription
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_sglang_importable()
    import sglang.srt.mem_cache.radix_cache  # noqa: F401  # the bulk of SGLang's import time

    from sglang_cp_hicache.kernels import transfer

    _send(channel, StartupEvent(spec.rank, "imported"))
    cfg = spec.config
    world = cfg.cp_size if spec.cp_mode else cfg.non_cp_ranks
    group_rank = spec.rank if spec.cp_mode else -1 - spec.rank
    group = _join_group(spec, world, group_rank)
    _send(channel, StartupEvent(spec.rank, "joined"))
    build = _build_0523 if cfg.sglang_version == "0.5.23" else _build_0518
    stack, engine = build(spec, group)
    if world > 1:
        torch.distributed.barrier()
        _set_collective_timeout(cfg.collective_timeout_s)
    transfer.reset_copy_stats()  # count the replay's copies only (not the warm-up)
    _send(channel, StartupEvent(spec.rank, "built"))
    return _RankSetup(world, group_rank, group, stack, engine, time.perf_counter() - started)


def _replay(
    spec: RankSpec, engine: Any, channel: Any, step_ref: list[Optional[int]],
    injected: Optional[FailureInjection],
) -> tuple[list[RequestRecord], float, float]:
    """Serve every request (or, in a fleet, those its coordinator feeds);
    (records, process CPU seconds, wall seconds)."""
    feed = RankFeed(spec.config.fleet_feed, spec.rank) if spec.config.fleet_feed is not None else None
    total = len(spec.requests)
    every = max(1, total // 200)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    records = []
    indices = feed.indices() if feed is not None else iter(range(total))
    if feed is not None:
        feed.ready()
    for index in indices:
        step_ref[0] = index
        # at the first request from STEP on: a fed rank serves only some indices
        if injected is not None and injected.step is not None and index >= injected.step:
            _inject(injected, engine)
            injected = None
        if feed is not None:
            feed.started(index)
        record = engine.serve(index, spec.requests[index])
        records.append(record)
        if feed is not None:
            feed.done(index, record.device_hit_tokens, record.host_hit_tokens, record.l3_hit_tokens,
                      record.verified_pages, record.corrupted_pages)
        if spec.progress and ((index + 1) % every == 0 or index + 1 == total):
            _send(channel, Progress(spec.rank, index + 1, total))
    if feed is not None:
        feed.close()
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    step_ref[0] = AFTER_REPLAY
    return records, cpu, wall


def _serve_all(spec: RankSpec, channel: Any, step_ref: list[Optional[int]]) -> RankReport:
    injected = spec.failure if spec.failure is not None and spec.failure.rank == spec.rank else None
    if injected is not None and injected.step is None:
        _inject(injected)  # before anything heavy is imported
    setup = _start_rank(spec, channel)
    engine = setup.engine
    records, cpu, wall = _replay(spec, engine, channel, step_ref, injected)

    from sglang_cp_hicache.kernels import transfer

    totals = engine.totals()
    metrics = scrape_library_metrics() if spec.cp_mode and spec.config.metrics else {}
    copies = transfer.copy_stats().as_dict()
    agreement = None
    if setup.world > 1:
        import torch.distributed as dist

        agreement = _agreement(totals.tree_digest, engine.acks.as_tuple(), setup.world)
        dist.destroy_process_group()
    else:  # a lone process (CP 1, or the single non-CP baseline) agrees with itself
        agreement = _agreement_of([(totals.tree_digest, engine.acks.as_tuple())])
    setup.stack.close()
    return RankReport(
        rank=spec.rank,
        cp_size=spec.config.cp_size if spec.cp_mode else 1,
        cp_mode=spec.cp_mode,
        records=records,
        totals=totals,
        acks=engine.acks,
        cpu_seconds=cpu,
        cache_cpu_seconds=engine.cache_cpu_seconds,
        content_cpu_seconds=engine.content_cpu_seconds,
        collective_cpu_seconds=engine.collective_cpu_seconds,
        collective_calls=engine.collective_calls,
        wall_seconds=wall,
        startup_seconds=setup.startup_seconds,
        agreement=agreement if setup.group_rank == 0 else None,
        copies=copies,
        indexer_pages_verified=engine.indexer_pages_verified,  # every verified page's indexer row too
        copy_path_cpu=asdict(engine.copy_times) if hasattr(engine, "copy_times") else {},
        page_bytes=engine.page_bytes,
        copy_wall=engine.copy_wall.as_dict(),
        metrics=metrics,
    )


def preload_release(version: str) -> None:
    """What every rank process of ``version`` (an SGLang release) imports
    first, done once in the zygote that forks them: torch, SGLang, the
    release's stack and engine modules, and the hook check's parse of
    SGLang's source (kept per class). Starts no thread and runs no torch op
    (the zygote forks afterwards)."""
    import torch  # noqa: F401

    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_sglang_importable()
    import sglang.srt.mem_cache.radix_cache  # noqa: F401

    from sglang_cp_hicache.kernels import transfer  # noqa: F401

    if version == "0.5.23":
        from sglang_cp_hicache.sglang_0523.hooks import check_hooks
        from sglang_cp_hicache.sim import engine_0523, engine_0523_plain  # noqa: F401
        from sglang_cp_hicache.testing import stack_0523  # noqa: F401
    else:
        from sglang_cp_hicache.sglang_0518.hooks import check_hooks
        from sglang_cp_hicache.sim import engine_0518  # noqa: F401
        from sglang_cp_hicache.testing import stack_0518  # noqa: F401
    check_hooks()


def forked_rank_main(spec: RankSpec, channel: Any, zygote_pid: int) -> None:
    """:func:`rank_main` in a process the zygote forked: it lives as long as the zygote."""
    rank_main(replace(spec, launcher_pid=zygote_pid), channel)


def rank_main(spec: RankSpec, channel: Any) -> None:
    """multiprocessing target: exit status 0 after a report, 1 after a failure,
    EXIT_LAUNCHER_GONE as soon as the launcher is gone; never returns."""
    die_with_launcher(spec.launcher_pid)
    _redirect_output(spec.log.fd)
    step_ref: list[Optional[int]] = [None]
    try:
        report = _serve_all(spec, channel, step_ref)
    except BaseException as exc:  # report anything, then exit non-zero
        at = time.monotonic()
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        _send(channel, RankFailure(spec.rank, step_ref[0], f"{type(exc).__name__}: {exc}", text, at=at))
        channel.close()
        sys.stdout.flush()
        os._exit(1)
    _send(channel, report)
    channel.close()
    # The report is out: leave now. Interpreter teardown would destroy the
    # gloo process group the cache still references in arbitrary order, and
    # gloo can abort there ("terminate called without an active exception"),
    # turning a finished rank into a crashed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
