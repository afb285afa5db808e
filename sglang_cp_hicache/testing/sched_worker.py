"""The stand-in model worker of the real-scheduler harness (both releases).

``Scheduler.init_tp_model_worker`` is the one model seam: the harness's
scheduler subclass builds :class:`StandInTpWorker` instead of
``TpModelWorker``. Its runner holds the REAL pools a server of that release
builds for a DSA model under CP (0.5.18: the library's
``CpSharedPagedTokenToKVPoolAllocator`` over SGLang's ``DSATokenToKVPool``;
0.5.23: SGLang's page-interleave sharded DSA pool and allocator over its
attn-CP group), and SGLang's own ``get_worker_info``. Only the forward is
the stand-in's (:mod:`.sched_forward`).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from sglang_cp_hicache.placement import CpPlacement
from sglang_cp_hicache.testing.sched_forward import BatchReport, ForwardStandIn

__all__ = ["PoolShape", "StandInTpWorker", "build_pools"]


@dataclass(frozen=True)
class PoolShape:
    page_size: int = 64
    device_pages: int = 16  # physical, per rank
    num_layers: int = 2
    max_running_requests: int = 8
    max_context_len: int = 4096
    chunk_tokens: int = 128  # the 0.5.23 shard spec's scratch is sized from the chunk, as upstream does


@dataclass
class Pools:
    req_to_token_pool: Any
    kv_pool: Any
    allocator: Any
    placement: Optional[CpPlacement]


def _pools_0518(shape: PoolShape, cp_size: int, cp_rank: int) -> Pools:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

    P = shape.page_size
    r2t = ReqToTokenPool(size=shape.max_running_requests, max_context_len=shape.max_context_len, device="cpu",
                         enable_memory_saver=False)
    # fp8_e4m3 as on 0.5.23: 576-byte rows, so both releases' pages (and L3 keys) are the same bytes
    kv = DSATokenToKVPool(size=shape.device_pages * P, page_size=P, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                          qk_rope_head_dim=64, layer_num=shape.num_layers, device="cpu", index_head_dim=128,
                          enable_memory_saver=False, kv_cache_dim=576)
    if cp_size == 1:
        alloc = PagedTokenToKVPoolAllocator(size=shape.device_pages * P, page_size=P, dtype=torch.float8_e4m3fn,
                                            device="cpu", kvcache=kv, need_sort=True)
        return Pools(r2t, kv, alloc, None)
    # where the model runner builds the KV pool under the plugin (the library's CP shared allocator)
    from sglang_cp_hicache.sglang_0518.allocator import CpSharedPagedTokenToKVPoolAllocator

    alloc = CpSharedPagedTokenToKVPoolAllocator(
        logical_size=(shape.device_pages * cp_size - 1) * P, physical_size=shape.device_pages * P, page_size=P,
        dtype=torch.float8_e4m3fn, device="cpu", kvcache=kv, need_sort=True, cp_size=cp_size, cp_rank=cp_rank)
    return Pools(r2t, kv, alloc, CpPlacement(P, cp_size, cp_rank))


def _pools_0523(shape: PoolShape) -> Pools:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
    from sglang.srt.runtime_context import get_parallel

    P = shape.page_size
    dsa = dict(page_size=P, dtype=torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=64,
               layer_num=shape.num_layers, device="cpu", kv_cache_dim=576, enable_memory_saver=False, start_layer=0,
               end_layer=shape.num_layers, index_head_dim=128, index_kpool=1, index_kpool_compress=False,
               tail_extra_slots=0, max_running_requests=shape.max_running_requests)
    r2t = ReqToTokenPool(size=shape.max_running_requests, max_context_len=shape.max_context_len, device="cpu",
                         enable_memory_saver=False)
    group = get_parallel().attn_cp_group
    if group.world_size == 1:
        kv = DSATokenToKVPool(shape.device_pages * P, **dsa)
        alloc = PagedTokenToKVPoolAllocator(shape.device_pages * P, page_size=P, dtype=torch.float8_e4m3fn,
                                            device="cpu", kvcache=kv, need_sort=True)
        return Pools(r2t, kv, alloc, None)
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.page_interleave import PageShardSpec
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    rank, n = group.rank_in_group, group.world_size
    # scratch sized as page_interleave.py sizes it for a server (a prefix region of whole granules, one
    # context per running request; else long prefixes are refused)
    granule = n * P
    spec = PageShardSpec(shard_rank=rank, shard_size=n, page_size=P,
                         max_prefix_tokens=shape.max_running_requests * -(-shape.max_context_len // granule) * granule,
                         chunk_tokens=shape.chunk_tokens)
    kv = PageInterleaveDSATokenToKVPool(shape.device_pages * P, shard_spec=spec, shard_group=group, **dsa)
    alloc = PageInterleavePoolAllocator(shape.device_pages * P, physical_page_size=P, shard_size=n,
                                        dtype=torch.float8_e4m3fn, device="cpu", kvcache=kv, need_sort=True,
                                        shard_spec=spec)
    return Pools(r2t, kv, alloc, CpPlacement(P, n, rank))


def build_pools(version: str, shape: PoolShape, cp_size: int, cp_rank: int) -> Pools:
    return _pools_0523(shape) if version == "0.5.23" else _pools_0518(shape, cp_size, cp_rank)


class StandInRunner:
    """The part of ``ModelRunner`` the scheduler reads, over real pools."""

    def __init__(self, version: str, model_config: Any, pools: Pools, shape: PoolShape, server_args: Any) -> None:
        self.model_config = model_config
        self.device = "cpu"
        self.forward_stream = torch.cpu.Stream()
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool = pools.kv_pool
        self.token_to_kv_pool_allocator = pools.allocator
        self.memory_pool_config = object()  # "already allocated": the scheduler allocates nothing more
        self.mtp_draft_device_pools = ()
        self.mtp_draft_mamba_pools = ()
        self.canary_manager = None
        self.hisparse_coordinator = None
        self.lora_manager = None
        self.prefill_aware_swa = False
        self.attn_backend = types.SimpleNamespace()
        self.weight_load_mem_usage = 0.0
        self.max_running_requests = shape.max_running_requests
        self.kv_cache_dtype_str = "fp8_e4m3"
        if version == "0.5.23":
            # per-rank physical; the scheduler widens it by the shard size
            self.logical_max_total_num_tokens = self.effective_logical_max_total_num_tokens = pools.kv_pool.size
        else:
            self.max_total_num_tokens = self.effective_max_total_num_tokens = pools.allocator.size
        self.ngram_embedding_manager = _ngram_manager(model_config, pools, shape, server_args)

    def prewarm_sampling(self) -> None:
        pass

    def account_preloaded_weights(self, n: Any) -> None:
        pass


def _ngram_manager(model_config: Any, pools: Pools, shape: PoolShape, server_args: Any) -> Any:
    try:
        from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager
    except ImportError:
        return None
    extra = {"server_args": server_args} if "server_args" in inspect.signature(
        NgramEmbeddingManager.from_model).parameters else {}
    return NgramEmbeddingManager.from_model(model=torch.nn.Module(), model_config=model_config,
                                            req_to_token_pool=pools.req_to_token_pool,
                                            max_running_requests=shape.max_running_requests, device="cpu", **extra)


class StandInTpWorker:
    """Duck of ``TpModelWorker``: the methods the scheduler calls (the seam
    registry checks ``TpModelWorker`` still has each of them)."""

    def __init__(self, version: str, scheduler: Any, shape: PoolShape, gate: Callable[[BatchReport], None],
                 rank: int) -> None:
        from sglang.srt.managers.tp_worker import TpModelWorker

        self.server_args = scheduler.server_args
        self.model_config = scheduler.model_config
        cp_size, cp_rank = 1, 0
        if version == "0.5.18":
            from sglang.srt.distributed import bootstrap

            ps = self.ps = scheduler.ps
            # 0.5.18 builds its process groups inside ModelRunner; the stand-in makes the same call
            bootstrap.init_torch_distributed(server_args=self.server_args, model_config=self.model_config,
                                             device="cpu", ps=ps, dist_port=scheduler.nccl_port,
                                             is_draft_worker=False, local_omp_cpuid=None)
            cp_size, cp_rank = ps.attn_cp_size, ps.attn_cp_rank
        pools = build_pools(version, shape, cp_size, cp_rank)
        self._model_runner = StandInRunner(version, self.model_config, pools, shape, self.server_args)
        self.model_runner_list = [self._model_runner]
        self.forward = ForwardStandIn(rank, pools.kv_pool, pools.req_to_token_pool.req_to_token, pools.placement,
                                      gate)
        self.forward.poison_allocations_of(pools.allocator)
        self.hicache_layer_transfer_counter: Any = None
        self.random_seed = 1
        self.device = "cpu"
        self.weight_load_time = 0.0
        self.graph_time_usage: dict = {}
        self.graph_memory_usage: dict = {}
        self.preloaded_weights_bytes = 0
        self.is_hybrid_swa = False
        self.sliding_window_size = None
        self.dllm_algorithm = None
        self._worker_info = TpModelWorker.get_worker_info  # SGLang's own

    def get_worker_info(self) -> Any:
        return self._worker_info(self)

    @property
    def model_runner(self) -> StandInRunner:
        return self._model_runner

    def get_memory_pool(self) -> tuple[Any, Any]:
        return self._model_runner.req_to_token_pool, self._model_runner.token_to_kv_pool_allocator

    def alloc_memory_pool(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_attention_backends(self) -> None:
        pass

    def init_cuda_graphs(self, *args: Any, **kwargs: Any) -> None:
        pass

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.hicache_layer_transfer_counter = counter

    def set_hicache_consumer(self, consumer_index: int) -> None:
        if self.hicache_layer_transfer_counter is not None:
            self.hicache_layer_transfer_counter.set_consumer(consumer_index)

    def get_pad_input_ids_func(self) -> None:
        return None

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        from sglang.srt.managers.utils import GenerationBatchResult

        return GenerationBatchResult(logits_output=None, next_token_ids=self.forward.next_tokens(batch),
                                     can_run_cuda_graph=False)
