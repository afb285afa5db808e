"""Every SGLang 0.5.18 name this adapter depends on, in one registry.

The adapter subclasses ``HiRadixCache``, ``TreeNode`` and the token
allocator, overrides their methods, calls their private helpers, replaces
copy methods on the host pool and controller INSTANCES of a CP cache
(:mod:`.host_copies`), edits the controller's queues in place and reads
attributes of upstream's pools, nodes and params. Each of those is one
:class:`Hook` in :data:`HOOKS`, read from SGLang :data:`READ_FROM`.

:func:`check_hooks` checks them all in the installed SGLang and refuses,
naming the first one that is missing or changed
(:mod:`sglang_cp_hicache.hook_registry` says how entries resolve).

Importing this module does not import SGLang.
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_hicache import hook_registry
from sglang_cp_hicache.hook_registry import (
    KINDS, Hook, HookMismatchError, attribute_hooks, find_problem, owner_hooks, page_byte_hooks,
)
from sglang_cp_hicache.sglang_0518 import SUPPORTED_SGLANG

__all__ = ["HOOKS", "KINDS", "READ_FROM", "Hook", "HookMismatchError", "check_hooks", "find_problem"]

#: The SGLang release every hook below was read from.
READ_FROM = SUPPORTED_SGLANG

_HRC = "sglang.srt.mem_cache.hiradix_cache"
_RC = "sglang.srt.mem_cache.radix_cache"
_BPC = "sglang.srt.mem_cache.base_prefix_cache"
_CIP = "sglang.srt.mem_cache.cache_init_params"
_CC = "sglang.srt.managers.cache_controller"
_HCC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
_MPH = "sglang.srt.mem_cache.memory_pool_host"
_MLA = "sglang.srt.mem_cache.pool_host.mla"
_PH_BASE = "sglang.srt.mem_cache.pool_host.base"
_MP = "sglang.srt.mem_cache.memory_pool"
_ALLOC = "sglang.srt.mem_cache.allocator.base"
_PAGED = "sglang.srt.mem_cache.allocator.paged"
_REG = "sglang.srt.mem_cache.registry"
_UTILS = "sglang.srt.mem_cache.utils"
_EVENTS = "sglang.srt.disaggregation.kv_events"
_METRICS = "sglang.srt.observability.metrics_collector"
_SA = "sglang.srt.server_args"
_RT = "sglang.srt.runtime_context"
_DPA = "sglang.srt.layers.dp_attention"
_SB = "sglang.srt.managers.schedule_batch"

_COPY_D2H = ("self", "device_pool", "host_indices", "device_indices", "io_backend")
_COPY_H2D = ("self", "device_pool", "host_indices", "device_indices", "layer_id", "io_backend", "is_draft")


# A maker for each owner with three or more hooks.
_cache = owner_hooks(_HRC, "HiRadixCache")
_alloc = owner_hooks(_ALLOC, "BaseTokenToKVPoolAllocator")
_hcc = owner_hooks(_HCC, "HybridCacheController")
_node = owner_hooks(_RC, "TreeNode")
_key = owner_hooks(_RC, "RadixKey")


def _classes() -> tuple[Hook, ...]:
    def cls(module: str, name: str, why: str, params: Optional[tuple[str, ...]] = None) -> Hook:
        return Hook(module, None, name, "call" if params is not None else "attribute", params, why)

    return (
        cls("sglang", "__version__", "pins the release it supports"),
        cls(_HRC, "HiRadixCache", "subclasses it (CpHiRadixCache)"),
        cls(_RC, "TreeNode", "subclasses it (CpTreeNode)"),
        cls(_RC, "RadixKey", "matches and slices keys as upstream"),
        cls(_ALLOC, "BaseTokenToKVPoolAllocator", "subclasses it (the CP shared allocator)"),
        cls(_PAGED, "PagedTokenToKVPoolAllocator", "takes its alloc_extend / alloc_decode signatures"),
        cls(_BPC, "InsertParams", "subclasses it (CpInsertParams adds value_pages)"),
        cls(_BPC, "MatchPrefixParams", "reads the key to match"),
        cls(_BPC, "InitLoadBackParams", "fills in the load-back quota"),
        cls(_BPC, "EvictResult", "reads what an eviction freed"),
        cls(_BPC, "IncLockRefResult", "reads the lock delta of a load-back"),
        cls(_CIP, "CacheInitParams", "reads the allocator it is built with"),
        cls(_CC, "HiCacheAck", "waits on and drops acks of taken-back operations"),
        cls(_HCC, "HybridCacheController", "queues CP operations on the DSA controller"),
        cls(_MPH, "HostPoolGroup", "finds the KV and indexer host pools"),
        cls(_MPH, "PoolEntry", "finds the host pool of each entry"),
        cls(_MPH, "DSAIndexerPoolHost", "replaces the indexer host pool's copies"),
        cls(_MLA, "MLATokenToKVPoolHost", "replaces the KV host pool's copies"),
        cls(_PH_BASE, "HostKVCache", "checks both host pools as one kind"),
        cls(_MP, "DSATokenToKVPool", "refuses other device pools and warms the kernels up for its buffers"),
        cls(_EVENTS, "StorageMedium", "records KV events with the medium"),
        cls(_REG, "TreeCacheBuildContext", "builds the cache from the factory context"),
        cls(_SA, "ServerArgs", "refuses server settings CP cannot honour"),
        cls(_SB, "Req", "sizes the load-back quota from the request"),
        cls(_METRICS, "RadixCacheMetricsCollector", "observes load-back durations as upstream"),
        cls(_METRICS, "StorageMetricsCollector", "feeds SGLang's storage metrics from the CP L3"),
        cls(_METRICS, "StorageMetrics", "logs per-operation L3 pages and bandwidth as SGLang's storage"),
        cls(_METRICS, "STAT_LOGGER_ROLE_STORAGE", "resolves the storage collector class as HiRadixCache"),
        cls(_METRICS, "resolve_collector_class", "resolves the storage collector class as HiRadixCache"),
        cls(_RT, "get_server_args", "reads the stat-logger settings of this server"),
        cls(_RT, "get_parallel", "labels the storage metrics with this rank's TP rank"),
        cls(_DPA, "is_dp_attention_enabled", "labels the storage metrics as SGLang under DP attention"),
        cls(_DPA, "get_attention_dp_rank", "labels the storage metrics as SGLang under DP attention"),
        cls(_BPC, "MatchResult", "returns match results as upstream (keywords)", (
            "device_indices", "last_device_node", "last_host_node", "best_match_node", "host_hit_length",
            "swa_host_hit_length", "mamba_host_hit_length", "mamba_branching_seqlen", "cache_protected_len",
            "full_kv_hit_length", "cache_actions")),
        cls(_BPC, "InsertResult", "returns insert results as upstream (prefix_len=)", (
            "prefix_len", "total_len", "last_device_node", "mamba_exist", "inserted_host_node",
            "host_insert_dropped", "cache_actions")),
        cls(_BPC, "EvictParams", "evicts device tokens for an owner lane (num_tokens=)",
            ("num_tokens", "swa_num_tokens", "mamba_num")),
        cls(_CC, "CacheOperation", "queues each CP write and load as an ordinary operation",
            ("host_indices", "device_indices", "node_id", "priority", "pool_transfers")),
        cls(_UTILS, "compute_node_hash_values", "hashes a new leaf as upstream's insert", ("node", "page_size")),
        cls(_UTILS, "split_node_hash_value", "splits hashes as upstream's _split_node",
            ("child_hash_value", "split_len", "page_size")),
        cls(_UTILS, "get_hash_str", "keys L3 pages by SGLang's page hash chain",
            ("token_ids", "prior_hash", "page_size")),
        cls(_REG, "register_radix_cache_backend", "registers the cp-hicache backend", ("name", "factory")),
        cls(_REG, "get_radix_cache_factory", "registers the backend once", ("name",)),
        cls(_REG, "default_radix_cache_factory", "defers to SGLang for a non-CP allocator", ("ctx",)),
    )


def _overrides() -> tuple[Hook, ...]:
    """Methods of upstream's classes the adapter's subclasses replace."""
    node = ("self", "node")
    return (
        _cache("__init__", "override", ("self", "params", "server_args"), "is built as upstream's"),
        _cache("reset", "override", ("self",), "puts a CpTreeNode root in after upstream's reset"),
        _cache("write_backup", "override", ("self", "node", "write_back"), "backs up only this rank's pages"),
        _cache("_finish_write_through_ack", "override", ("self", "ack_id", "release_lock"),
               "keeps the write whose ack is consumed"),
        _cache("_sync_hicache_ready_counts", "override", ("self",),
               "folds its step status into the ready-ack all-reduce"),
        _cache("writing_check", "override", ("self", "write_back", "finish_count"),
               "runs the step exchange before consuming write acks"),
        _cache("loading_check", "override", ("self", "finish_count"),
               "runs the step exchange before consuming load acks"),
        _cache("evict", "override", ("self", "params"), "keeps the last eviction result for the OOM message"),
        _cache("available_and_evictable_str", "override", ("self",), "adds the allocator state to the OOM message"),
        _cache("_update_host_leaf_status", "override", node, "keeps host leaves in its ordered index"),
        _cache("evict_host", "override", ("self", "num_tokens"), "evicts the same host nodes on every rank"),
        _cache("load_back", "override", ("self", "node", "mem_quota"), "restores pages with their owners"),
        _cache("ready_to_load_host_cache", "override", ("self",), "starts loads without a collective"),
        _cache("init_load_back", "override", ("self", "params"), "fills in the quota SGLang leaves None"),
        _cache("match_prefix", "override", ("self", "params"), "counts host hits in logical tokens"),
        _cache("_split_node", "override", ("self", "key", "child", "split_len"),
               "splits the CP host state and the page mirror"),
        _cache("insert", "override", ("self", "params"), "carries the CPU page mirror into the tree"),
        _cache("cache_unfinished_req", "override", ("self", "req", "chunked"),
               "answers the chunk checkpoint's insert and frees from the request's CPU row"),
        _cache("cache_finished_req", "override", ("self", "req", "is_insert", "kv_len_to_handle"),
               "answers the finished request's insert and frees from its CPU row"),
        _cache("_evict_backuped", "override", node, "frees device pages through the CPU mirror"),
        _cache("_evict_regular", "override", node, "frees device pages through the CPU mirror"),
        _cache("prefetch_from_storage", "override",
               ("self", "req_id", "last_host_node", "new_input_tokens", "last_hash", "prefix_keys"),
               "serves the scheduler's prefetch on arrival from the CP L3"),
        _cache("check_prefetch_progress", "override", ("self", "req_id"),
               "holds a request until its CP L3 prefetch settled"),
        _cache("release_aborted_request", "override", ("self", "rid"),
               "drops an aborted request's CP L3 prefetch at the next step"),
        _cache("attach_storage_backend", "override", (
            "self", "storage_backend", "storage_backend_extra_config_json", "served_model_name",
            "hicache_storage_prefetch_policy", "hicache_write_policy"), "refuses a runtime attach under CP"),
        _cache("detach_storage_backend", "override", ("self",), "refuses a runtime detach under CP"),
        _cache("clear_storage_backend", "override", ("self",), "clears this deployment's CP L3 namespaces"),
        _cache("check_hicache_events", "override", ("self",), "publishes the step's L3 and library metrics after upstream's"),
        _node("__init__", "override", ("self", "id", "priority"), "builds CpTreeNode as upstream"),
        _node("backuped", "override", None, "answers backuped from the CP host state"),
        _alloc("clear", "override", ("self",), "allocates by owner lanes"),
        _alloc("available_size", "override", ("self",), "allocates by owner lanes"),
        _alloc("alloc", "override", ("self", "need_size"), "allocates by owner lanes"),
        _alloc("free", "override", ("self", "free_index"), "frees into owner lanes"),
        _alloc("free_segment", "override", ("self", "free_index", "start_pos"),
               "frees a served request's row slices through its CPU row"),
        _alloc("merge_and_sort_free", "override", ("self",), "sorts its lanes after a take-back"),
        Hook(_PAGED, "PagedTokenToKVPoolAllocator", "alloc_extend", "override", (
            "self", "prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc",
            "extend_num_tokens", "num_new_pages"), "serves the scheduler's extend allocations"),
        Hook(_PAGED, "PagedTokenToKVPoolAllocator", "alloc_decode", "override",
             ("self", "seq_lens", "seq_lens_cpu", "last_loc"), "serves the scheduler's decode allocations"),
    )


def _instance_replacements() -> tuple[Hook, ...]:
    """What the adapter overwrites on upstream's instances."""
    return (
        Hook(_MLA, "MLATokenToKVPoolHost", "backup_from_device_all_layer", "replaced-on-instance", _COPY_D2H,
             "binds the CP backup (this library's kernels) to the KV host pool instance"),
        Hook(_MLA, "MLATokenToKVPoolHost", "load_to_device_per_layer", "replaced-on-instance", _COPY_H2D,
             "binds the CP load to the KV host pool instance"),
        Hook(_MPH, "DSAIndexerPoolHost", "backup_from_device_all_layer", "replaced-on-instance", _COPY_D2H,
             "binds the CP backup to the indexer host pool instance"),
        Hook(_MPH, "DSAIndexerPoolHost", "load_to_device_per_layer", "replaced-on-instance", _COPY_H2D,
             "binds the CP load to the indexer host pool instance"),
        Hook(_MP, "ReqToTokenPool", "alloc", "replaced-on-instance", ("self", "reqs"),
             "learns each extend batch's request order (it runs just before alloc_extend)"),
        _hcc("move_indices", "replaced-on-instance",
             ("self", "host_indices", "device_indices"), "keeps device-side indices for the kernels"),
        _hcc("_move_write_operation", "replaced-on-instance", ("self", "op"),
             "never takes the page_first write-back path"),
        _cache("evictable_host_leaves", "replaced-on-instance", None,
               "replaces upstream's set by a guard (its own ordered index is the truth)"),
        _cache("root_node", "replaced-on-instance", None, "puts a CpTreeNode root in after reset"),
        _cache("_empty_match_result", "replaced-on-instance", None, "points the empty match at its root"),
        _node("children", "replaced-on-instance", None,
              "uses a plain dict (a missed lookup raises instead of adding an orphan)"),
    )


def _private_helpers() -> tuple[Hook, ...]:
    node = ("self", "node")
    return (
        _cache("_all_reduce", "private-helper", ("self", "data", "tp_reduce_op"),
               "folds its step status into SGLang's ready-ack all-reduce"),
        _cache("_count_ready_acks", "private-helper", ("self", "ack_queue"), "counts ready acks as upstream"),
        _cache("_get_extra_pools", "private-helper", ("self",), "queues the indexer with every KV copy"),
        _cache("_track_write_through_node", "private-helper", ("self", "node", "backup_len"),
               "tracks each CP write as upstream"),
        _cache("_replace_pending_write_through_node", "private-helper", ("self", "old_node", "new_nodes"),
               "follows a split of a node with a write in flight"),
        _cache("_record_remove_event", "private-helper", ("self", "node", "medium"), "records KV events"),
        _cache("_record_store_event", "private-helper", ("self", "node", "medium"), "records KV events"),
        _cache("_detach_backuped", "private-helper", node, "evicts a backed-up node's device copy"),
        _cache("_delete_leaf", "private-helper", node, "deletes an evicted leaf"),
        _cache("_update_leaf_status", "private-helper", node, "keeps upstream's device leaf set"),
        _cache("_make_eviction_heap", "private-helper", ("self",), "reclaims a lane in upstream's LRU order"),
        _cache("_promote_parent", "private-helper", ("self", "node", "heap"), "reclaims a lane as evict() does"),
        _cache("_inc_hit_count", "private-helper", ("self", "node", "chunked"), "triggers write-through"),
        _cache("_match_prefix_helper", "private-helper", node + ("key",), "matches as upstream"),
        _hcc("_resolve_pool_transfers_allocation", "private-helper",
             ("self", "extra_pools", "alloc_host", "kv_device_indices", "kv_host_indices"),
             "resolves the indexer transfer of each CP operation"),
        _hcc("_move_op_indices", "private-helper", ("self", "op"), "prepares a CP write as loads are prepared"),
        _alloc("_copy_for_free_group", "private-helper", ("free_index",),
               "defers frees inside a free group as upstream"),
        Hook(_PH_BASE, "HostKVCache", "_is_device_layer_sharded", "private-helper",
             ("self", "device_pool"), "refuses layer-sharded device pools (both host pools)"),
    )


def _calls() -> tuple[Hook, ...]:
    """Public methods the adapter calls on upstream's objects."""
    return (
        _cache("inc_lock_ref", "call", ("self", "node"), "locks nodes with writes or loads in flight"),
        _cache("dec_lock_ref", "call", ("self", "node", "params"), "unlocks them"),
        _cache("evictable_size", "call", ("self",), "reports it on OOM"),
        _cache("update_eviction_metrics", "call", ("self", "num_evicted", "start_time"),
               "counts lane reclaims in SGLang's eviction metrics"),
        _node("protect_host", "call", ("self",), "protects host copies during a load-back"),
        _node("release_host", "call", ("self",), "releases them"),
        _key("maybe_to_bigram_view", "call", ("self", "is_eagle", "value"), "matches as upstream"),
        _key("page_aligned", "call", ("self", "page_size"), "matches as upstream"),
        _key("child_key", "call", ("self", "page_size"), "indexes children as upstream"),
        _key("match", "call", ("self", "other", "page_size"), "matches as upstream"),
        Hook(_BPC, "MatchResult", "_replace", "call", ("self", "kwds"), "points the empty match at its root"),
        _alloc("__init__", "call", ("self", "size", "page_size", "dtype", "device", "kvcache", "need_sort"),
               "builds its allocator on upstream's base"),
        _alloc("get_kvcache", "call", ("self",), "reads the device pool"),
        _hcc("start_writing", "call", ("self",), "submits a CP write"),
        _hcc("start_loading", "call", ("self",), "submits the queued CP loads"),
        _hcc("evict_host", "call", ("self", "host_indices", "backup_only"),
             "frees this rank's host slots of an evicted node"),
        Hook(_MPH, "HostPoolGroup", "alloc", "call", ("self", "need_size"), "takes host slots for a write"),
        Hook(_MPH, "HostPoolGroup", "free", "call", ("self", "indices"), "frees host slots of a taken-back write"),
        *page_byte_hooks(_MLA, _MPH),
        Hook(_METRICS, "RadixCacheMetricsCollector", "observe_load_back_duration", "call",
             ("self", "duration_seconds"), "observes load-back durations"),
    )


def _attributes() -> tuple[Hook, ...]:
    return (
        *attribute_hooks(_HRC, "HiRadixCache", "page_size disable is_eagle enable_storage enable_kv_cache_events "
                "cache_controller token_to_kv_pool_allocator token_to_kv_pool_host eviction_strategy "
                "load_back_threshold metrics_collector pp_rank attn_cp_group",
                "reads the cache's settings, pools, controller and CP group"),
        *attribute_hooks(_HRC, "HiRadixCache", "req_to_token_pool",
                "learns each extend batch's request order from the scheduler's request pool"),
        *attribute_hooks(_HRC, "HiRadixCache", "pp_size storage_metrics_collector",
                "labels the L3 metrics like SGLang's storage metrics and sets SGLang's storage collector"),
        *attribute_hooks(_HRC, "HiRadixCache", "prefetch_loaded_tokens_by_reqid",
                "records each request's L3 hit for upstream's pop_prefetch_loaded_tokens"),
        *attribute_hooks(_HRC, "HiRadixCache", "ongoing_write_through ongoing_load_back evictable_size_",
                "edits them in place when it takes operations back (ongoing_write_through values: "
                "(lock_node, backup_len, publish_nodes))"),
        *attribute_hooks(_HCC, "HybridCacheController", "write_queue load_queue ack_write_queue ack_load_queue",
                "queues CP operations and drops the acks of taken-back ones, in place"),
        *attribute_hooks(_HCC, "HybridCacheController", "prefetch_hit_queue ack_backup_queue host_mem_release_queue",
                "passes the storage counts through the step all-reduce"),
        *attribute_hooks(_HCC, "HybridCacheController", "mem_pool_host write_policy layer_done_counter device",
                "reads the host pools, write policy, layer counter and device"),
        *attribute_hooks(_CC, "CacheOperation", "node_ids host_indices", "finds and frees a taken-back write"),
        *attribute_hooks(_CC, "HiCacheAck", "node_ids finish_event", "waits on and drops acks of taken-back operations"),
        *attribute_hooks(_MPH, "HostPoolGroup", "anchor_entry entries layout size", "finds the host pools and agrees on them"),
        *attribute_hooks(_MPH, "PoolEntry", "host_pool device_pool",
                "binds each host pool's copies to the device pool of its entry"),
        *attribute_hooks(_MLA, "MLATokenToKVPoolHost", "kv_buffer layout dcp_size mtp_draft_device_pools",
                "copies KV rows and refuses decode CP / MTP draft layers"),
        *attribute_hooks(_MPH, "DSAIndexerPoolHost", "index_k_with_scale_buffer layout dcp_size mtp_draft_device_pools",
                "copies indexer rows and refuses decode CP / MTP draft layers"),
        *attribute_hooks(_MP, "DSATokenToKVPool", "kv_buffer index_k_with_scale_buffer", "warms the kernels up for them"),
        *attribute_hooks(_MP, "DSATokenToKVPool", "start_layer", "names the L3 namespace's first layer"),
        *attribute_hooks(_MLA, "MLATokenToKVPoolHost", "page_size layer_num kv_cache_dim", "sizes the L3 KV namespace"),
        *attribute_hooks(_MPH, "DSAIndexerPoolHost", "layer_num indexer_page_stride_size", "sizes the L3 indexer namespace"),
        *attribute_hooks(_RC, "RadixKey", "token_ids extra_key cache_salt is_bigram",
                "hashes L3 pages from the token ids; keeps keyed/salted/bigram keys out of L3"),
        *attribute_hooks(_ALLOC, "BaseTokenToKVPoolAllocator", "is_not_in_free_group free_group page_size device",
                "defers frees inside a free group as upstream"),
        *attribute_hooks(_RC, "TreeNode", "id key value parent lock_ref priority hit_count hash_value event_hash_value "
                "last_access_time host_value write_through_pending_id evicted",
                "edits nodes as upstream's tree methods do"),
        *attribute_hooks(_BPC, "MatchResult", "device_indices", "returns the empty match's indices"),
        *attribute_hooks(_BPC, "MatchPrefixParams", "key", "reads the key to match"),
        *attribute_hooks(_BPC, "InsertParams", "key value chunked priority", "reads what to insert"),
        *attribute_hooks(_BPC, "InitLoadBackParams", "mem_quota req host_hit_length", "fills in the load-back quota"),
        *attribute_hooks(_BPC, "EvictResult", "num_tokens_evicted", "reads what an eviction freed"),
        *attribute_hooks(_BPC, "IncLockRefResult", "delta", "reads the lock delta of a load-back"),
        *attribute_hooks(_CIP, "CacheInitParams", "token_to_kv_pool_allocator page_size",
                "reads the allocator it is built with and checks its page size against the allocator's"),
        *attribute_hooks(_EVENTS, "StorageMedium", "GPU CPU", "records KV events with the medium"),
        *attribute_hooks(_REG, "TreeCacheBuildContext", "params server_args enable_hierarchical_cache tp_worker",
                "builds the cache and registers its layer counter with the worker"),
        *attribute_hooks(_SA, "ServerArgs", "hicache_storage_backend hicache_storage_backend_extra_config",
                "serves --hicache-storage-backend file from the CP L3 (in the directory it names), "
                "refuses other backends, builds the base cache without SGLang's storage"),
        *attribute_hooks(_SA, "ServerArgs", "hicache_write_policy", "refuses write_back"),
        *attribute_hooks(_SA, "ServerArgs", "served_model_name model_path", "names the model in the L3 namespace"),
        *attribute_hooks(_SB, "Req", "full_untruncated_fill_ids prefix_indices",
                "keeps room for the request's own new tokens in the load-back quota"),
    )


#: Every hook, classes first (see the module doc).
HOOKS: tuple[Hook, ...] = _classes() + _overrides() + _instance_replacements() + _private_helpers() + _calls() + _attributes()


def check_hooks(hooks: tuple[Hook, ...] = HOOKS) -> None:
    """Raise :class:`HookMismatchError` naming the first hook that is missing
    or changed in the installed SGLang."""
    hook_registry.check_hooks(hooks, READ_FROM, '')
