"""Every SGLang 0.5.23 name this adapter depends on, in one registry.

The adapter subclasses upstream classes, calls their private helpers, replaces
one attribute on each controller instance, edits the strategy list in place
and reads attributes of upstream's pools and configs. Each of those is one
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
    Hook, HookMismatchError, attribute_hooks, find_problem, owner_hooks, page_byte_hooks,
)
from sglang_cp_hicache.sglang_0523 import SUPPORTED_SGLANG

__all__ = ["HOOKS", "READ_FROM", "Hook", "HookMismatchError", "check_hooks", "find_problem"]

#: The SGLang release every hook below was read from.
READ_FROM = SUPPORTED_SGLANG

_ASM = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_HPC = "sglang.srt.mem_cache.hybrid_cache.host_pool_config"
_HCC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
_CC = "sglang.srt.managers.cache_controller"
_L2 = "sglang.srt.mem_cache.l2_transfer"
_STORAGE = "sglang.srt.mem_cache.hicache_storage"
_PIP = "sglang.srt.mem_cache.page_interleave_pool"
_PI = "sglang.srt.mem_cache.page_interleave"
_PH_PI = "sglang.srt.mem_cache.pool_host.page_interleave"
_PH_MLA = "sglang.srt.mem_cache.pool_host.mla"
_PH_DSA = "sglang.srt.mem_cache.pool_host.dsa"
_PH_BASE = "sglang.srt.mem_cache.pool_host.base"
_GROUP = "sglang.srt.mem_cache.pool_host.group"
_DECL = "sglang.srt.mem_cache.pool_host.host_pool_decl"
_MEMPOOL = "sglang.srt.mem_cache.memory_pool"
_PARAMS = "sglang.srt.mem_cache.cache_init_params"
_URC = "sglang.srt.mem_cache.unified_radix_cache"
_TREE = "sglang.srt.mem_cache.unified_cache.unified_tree_core"
_TREE_IF = "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface"
_FULL = "sglang.srt.mem_cache.unified_cache.components.full"
_COMP_BASE = "sglang.srt.mem_cache.unified_cache.components.base"
_ALLOC_PI = "sglang.srt.mem_cache.allocator.page_interleave"
_RES = "sglang.srt.arg_groups.resolution_hooks"
_MOB = "sglang.srt.arg_groups.model_override_base"
_KSH = "sglang.srt.arg_groups.kv_shard_hook"
_BPC = "sglang.srt.mem_cache.base_prefix_cache"
_RADIX = "sglang.srt.mem_cache.radix_cache"
_MC_UTILS = "sglang.srt.mem_cache.utils"
_COMMON = "sglang.srt.mem_cache.common"
_SB = "sglang.srt.managers.schedule_batch"
_METRICS = "sglang.srt.observability.metrics_collector"
_ACTIONS = "sglang.srt.mem_cache.unified_cache.cache_action"
# A maker for each owner with three or more hooks.
_urc = owner_hooks(_URC, "UnifiedRadixCache")
_hcc = owner_hooks(_HCC, "HybridCacheController")
_l2 = owner_hooks(_L2, "L2TransferEngine")
_tree = owner_hooks(_TREE, "UnifiedTreeCore")
_alloc = owner_hooks(_ALLOC_PI, "PageInterleavePoolAllocator")
_STEP_PARAMS = ("self", "transfers", "transfer_layer_id_max", "start_event", "on_layer_done")
_BUILD_PARAMS = (
    "self", "cache", "kvcache", "params", "server_args", "load_cache_event", "storage_backend",
    "storage_backend_extra_config", "prefetch_threshold", "model_name", "enable_storage_metrics",
)
_CONTROLLER_PARAMS = (
    "self", "token_to_kv_pool_allocator", "mem_pool_host", "page_size", "tp_group", "load_cache_event",
    "attn_cp_group", "attn_tp_group", "pp_group", "write_policy", "io_backend", "storage_backend",
    "prefetch_threshold", "model_name", "storage_backend_extra_config", "transfer_layer_id_max",
    "enable_storage_metrics", "host_memory_mode",
)


def _classes() -> tuple[Hook, ...]:
    def cls(module: str, name: str, why: str, params: Optional[tuple[str, ...]] = None) -> Hook:
        return Hook(module, None, name, "call" if params else "attribute", params, why)

    return (
        cls("sglang", "__version__", "pins the release it supports"),
        cls(_ASM, "_DsaStrategy", "subclasses upstream's DSA stack strategy"),
        cls(_ASM, "_STRATEGIES", "reads the strategy list to prove its strategy is first "
            "and removes it from the list in place on uninstall"),
        cls(_HCC, "HybridCacheController", "subclasses the sharded HiCache controller"),
        cls(_L2, "L2TransferEngine", "subclasses the L2 transfer engine"),
        cls(_PIP, "PageInterleaveKVPoolMixin", "matches only KV-sharded device pools"),
        cls(_PH_PI, "PageInterleaveHostPool", "unwraps the sharded anchor host pool"),
        cls(_PH_MLA, "MLATokenToKVPoolHost", "copies the latent KV rows of the native host pool"),
        cls(_PH_DSA, "DSAIndexerPoolHost", "copies the page-major indexer rows"),
        cls(_HPC, "HostPoolGroupConfig", "reads the prepared host pool config"),
        cls(_HPC, "HostPoolConfig", "reads each pool's declaration"),
        cls(_DECL, "HostPoolDecl", "builds the sidecar list as upstream does"),
        cls(_GROUP, "HostPoolGroup", "reads the built host pool group"),
        cls(_GROUP, "PoolEntry", "reads each host pool entry"),
        cls(_PI, "PageInterleavePlacement", "narrows host slots to this rank's rows"),
        cls(_PI, "PageShardSpec", "reads the pool's shard rank and size"),
        cls(_MEMPOOL, "KVCache", "reads the device pool's size, device and layers"),
        cls(_PH_BASE, "HostKVCache", "reads the host pool's size, page size and layout"),
        cls(_PARAMS, "CacheInitParams", "reads the cache parameters upstream's DSA strategy reads"),
        cls("sglang.srt.arg_groups.fields.memory", "Memory", "reads the HiCache settings"),
        cls(_STORAGE, "PoolName", "looks up the kv and indexer host pools"),
        cls(_URC, "UnifiedRadixCache", "makes owner-aware host room for its backups"),
        cls(_TREE, "UnifiedTreeCore", "walks the host leaves and the rotation phases of nodes"),
        cls(_TREE, "UnifiedTreeNode", "reads a node's rotation base, parent and FULL data"),
        cls(_FULL, "FullComponent", "learns which node a device free comes from"),
        cls(_COMP_BASE, "EvictLayer", "tells device evictions from host ones"),
        cls(_COMP_BASE, "ComponentData", "reads a node's device locs and host slots"),
        cls(_TREE_IF, "DriveHostEvictionResult", "collects one host leaf's frees as upstream's host eviction does"),
        cls(_ALLOC_PI, "PageInterleavePoolAllocator", "frees evicted nodes' device pages into its class lists"),
        cls("sglang.srt.mem_cache.unified_cache.component_type", "ComponentType",
            "maps the FULL component to the KV host pool"),
        cls(_ASM, "register_stack_strategy", "registers its strategy ahead of upstream's", ("strategy",)),
        cls(_ASM, "build_host_pool_group", "builds the host pool group as upstream's DSA strategy does",
            ("config",)),
        cls(_ASM, "StackBuildResult", "returns what upstream's DSA strategy returns", (
            "host_pool_group", "cache_controller", "component_host_pools", "sidecars",
            "register_req_to_token_counter", "pools_desc", "pool_declarations")),
        cls(_HPC, "prepare_host_pool_config", "prepares the host pools as upstream's DSA strategy does", (
            "decls", "full_layer_mapping", "transfer_layer_id_max", "transfer_page_size",
            "packed_draft_device_pools")),
        cls("sglang.srt.runtime_context", "get_memory", "reads the published HiCache settings", ()),
        cls(_CC, "CacheOperation", "sends an empty write and load through upstream's paths at start-up",
            ("host_indices", "device_indices", "node_id", "priority", "pool_transfers")),
        cls(_STORAGE, "PoolTransfer", "narrows each pool transfer's host side (dataclasses.replace)", (
            "name", "host_indices", "device_indices", "keys", "hit_policy", "nodes_to_load",
            "indices_from_pool", "block_pages", "group_pages")),
        cls(_L2, "L2Transfer", "copies each resolved transfer itself", (
            "host_pool", "device_pool", "host_indices", "device_indices", "layer_mapper", "is_draft")),
        cls(_L2, "TransferCompletion", "waits on the finish event of the start-up transfers",
            ("start_event", "finish_event", "timing_enabled")),
    )


def _seam() -> tuple[Hook, ...]:
    """Overrides, the instance replacement and the private helpers."""
    return (
        Hook(_ASM, "_DsaStrategy", "build", "override", _BUILD_PARAMS,
             "builds the sharded DSA stack with its controller in place of upstream's"),
        Hook(_ASM, "_DsaStrategy", "matches", "override", ("self", "kvcache", "components"),
             "narrows the match to the sharded DSA pool and calls upstream's"),
        _hcc("__init__", "override", _CONTROLLER_PARAMS,
             "constructs its controller with upstream's DSA strategy arguments"),
        _hcc("_move_kv_shard_indices", "override", ("self", "operation", "write_back_jit"),
             "prepares sharded transfers with logical device locs (no owned_rows)"),
        _hcc("load", "override",
             ("self", "host_indices", "priority", "node_id", "extra_pools", "device_indices", "anchor_indices"),
             "counts each load-back (the live metrics) and calls upstream's"),
        _hcc("l2_transfer_engine", "replaced-on-instance", None,
             "replaces each controller's engine with LibraryL2TransferEngine after upstream's __init__"),
        _hcc("_move_write_operation", "private-helper", ("self", "op"),
             "sends the start-up empty write through upstream's write preparation"),
        _hcc("_move_op_indices", "private-helper", ("self", "op"),
             "sends the start-up empty load through upstream's load preparation"),
        _hcc("_l2_transfers", "private-helper", ("self", "host_indices", "device_indices", "pool_transfers"),
             "resolves the start-up empty write as upstream does"),
        _hcc("_l2_load_transfers", "private-helper", ("self", "host_indices", "device_indices", "pool_transfers"),
             "resolves the start-up empty load as upstream does"),
        _l2("__init__", "override", ("self", "io_backend"), "constructs its engine as upstream's"),
        _l2("submit_device_to_host", "override", ("self", "transfers"),
            "runs each backup through the library's kernels"),
        _l2("submit_host_to_device", "override", _STEP_PARAMS, "runs each layer's load through the library's kernels"),
        _urc("_execute_kv_backup", "replaced-on-instance",
             ("self", "node_id", "device_value", "comp_xfers", "sidecar_xfers"),
             "replaces each sharded cache's backup with one that makes owner-aware host room"),
        _urc("_apply_eviction_result", "private-helper", ("self", "result"),
             "drains each host leaf it evicts as upstream's host eviction does"),
        _tree("_evict_host_leaf", "private-helper",
              ("self", "node", "tracker", "device_frees", "host_frees", "cache_actions"),
              "evicts the host leaves that hold pages of a class a backup is short of"),
        _tree("_split_node", "private-helper", ("self", "key", "child", "split_len"),
              "cuts off the tail of a host leaf that is all a backup needs, keeping the prefix on the host"),
        Hook(_TREE, "UnifiedTreeNode", "last_access_time", "replaced-on-instance", None,
             "gives both halves of a split host leaf the leaf's recency (the split stamps them as new)"),
        Hook(_FULL, "FullComponent", "evict_component", "replaced-on-instance",
             ("self", "node", "device_frees", "host_frees", "cache_actions", "target"),
             "remembers the rotation phase of each node whose device value it queues for freeing"),
        Hook(_FULL, "FullComponent", "_ensure_eviction_strategy", "private-helper", ("self",),
             "binds the eviction priority as upstream's host eviction does"),
        _alloc("free_segment", "replaced-on-instance", ("self", "free_index", "start_pos"),
               "frees an evicted node's pages from its rotation phase (no host read)"),
        _alloc("free", "replaced-on-instance", ("self", "free_index"),
               "counts the frees that still read their locs on the host"),
        _alloc("free_group_end", "replaced-on-instance", ("self",),
               "frees the phase-known frees held in a free group as upstream's one free of the group would"),
        _urc("insert", "replaced-on-instance", ("self", "params"),
             "frees the tree's duplicates of an insert (slices of its value) from the chain's rotation"),
        _urc("claim_kv_row", "replaced-on-instance", ("self", "req"),
             "learns which request release_kv_cache is releasing (it calls this first)"),
        _urc("free_kv_row", "replaced-on-instance", ("self", "kv", "ranges"),
             "frees a released request's own pages (slices of its row) from the request's rotation"),
        _urc("on_release", "replaced-on-instance", ("self", "req", "checkpointed"),
             "forgets the request at the end of its release (release_kv_cache calls this last)"),
        Hook(_COMMON, None, "release_kv_cache", "call", ("req", "tree_cache", "checkpoint"),
             "the scheduler's release: claim_kv_row, checkpoint, free_kv_row, on_release, in that order"),
        Hook(_COMMON, None, "free_kv_row_segments", "call",
             ("allocator", "segments", "swa_evicted_seqlen", "swa_dead_lo"),
             "frees slices of the request's row through free_segment(s) with their row positions"),
        _l2("_submission", "private-helper", ("self", "transfers", "stream", "transfer_key", "start_event"),
            "keeps upstream's streams, events, layout leases and index preparation"),
    )


def _attributes() -> tuple[Hook, ...]:
    return (
        *attribute_hooks(_HCC, "HybridCacheController", "is_kv_sharded mem_pool_host io_backend device "
                "transfer_layer_id_max", "reads the controller's pools, io backend and device"),
        *attribute_hooks(_CC, "CacheOperation", "host_indices device_indices pool_transfers",
                "prepares each operation's transfers"),
        *attribute_hooks(_L2, "L2TransferEngine", "device_to_host_stream host_to_device_stream",
                "submits on upstream's two streams"),
        *attribute_hooks(_PH_PI, "PageInterleaveHostPool", "host_pool placement shard_rank shard_size",
                "narrows host slots to this rank and unwraps the native pool"),
        *attribute_hooks(_PI, "PageInterleavePlacement", "local_mask local_index", "narrows host slots to local rows"),
        *attribute_hooks(_PI, "PageShardSpec", "shard_rank shard_size page_size", "names this rank in the start-up agreement"),
        *attribute_hooks(_PIP, "PageInterleaveKVPoolMixin", "shard_spec shard_group shard_rank shard_size",
                "gathers the start-up agreement over the pool's shard group"),
        *attribute_hooks(_PH_MLA, "MLATokenToKVPoolHost", "_target_layer_indices device_kv_buffers kv_buffer dcp_size",
                "copies latent KV rows and refuses a non-identity layer map or decode CP"),
        *attribute_hooks(_PH_DSA, "DSAIndexerPoolHost", "_live_target_layers layer_num index_k_with_scale_buffer "
                "packed_device_index_buffers device_pool",
                "copies indexer rows to and from its device pool and refuses skipped indexer layers"),
        *attribute_hooks(_PH_BASE, "HostKVCache", "size page_size layout", "checks the host layout and agrees on host pages"),
        *attribute_hooks(_MEMPOOL, "KVCache", "size device layer_num layer_shard_enabled host_pool_decls",
                "builds the host pools and agrees on device pages"),
        *attribute_hooks(_HPC, "HostPoolGroupConfig", "transfer_page_size pools", "builds the controller and result"),
        *attribute_hooks(_HPC, "HostPoolConfig", "decl", "builds the result's declarations"),
        *attribute_hooks(_DECL, "HostPoolDecl", "is_primary sidecar_spec pool_name", "builds the result's sidecars"),
        *attribute_hooks(_GROUP, "HostPoolGroup", "layout entries anchor_entry entry_map get_pool",
                "checks the host pools and finds the anchor"),
        *attribute_hooks(_GROUP, "PoolEntry", "name host_pool", "checks the host pools"),
        *attribute_hooks(_PARAMS, "CacheInitParams", "page_size mtp_draft_device_pools token_to_kv_pool_allocator "
                "tp_cache_group attn_cp_cache_group attn_tp_cache_group pp_cache_group",
                "passes upstream's DSA strategy arguments"),
        *attribute_hooks("sglang.srt.arg_groups.fields.memory", "Memory",
                "hicache_write_policy hicache_io_backend hicache_host_memory_mode",
                "passes the HiCache settings to the controller"),
        *attribute_hooks(_STORAGE, "PoolName", "KV INDEXER", "looks up the kv and indexer host pools"),
        *attribute_hooks("sglang.srt.mem_cache.unified_cache.component_type", "ComponentType", "FULL",
                "maps the FULL component to the KV host pool"),
        _hcc("write", "call", ("self", "device_indices", "priority", "node_id", "extra_pools", "flush", "start_owner"),
             "queues each backup exactly as upstream's _execute_kv_backup does"),
        *attribute_hooks(_URC, "UnifiedRadixCache", "tree_core cache_controller host_memory_mode components is_write_back",
                "makes host room and finds the FULL component"),
        *attribute_hooks(_TREE, "UnifiedTreeCore", "rotation_phase_of evictable_host_leaves components_by_type root_node",
                "walks the host leaves in upstream's order and reads the rotation phases"),
        *attribute_hooks(_TREE, "UnifiedTreeNode", "parent id component evicted backuped children "
                "component_data", "reads a node's chain rotation, place in the tree, tiers and locks"),
        *attribute_hooks(_FULL, "FullComponent", "session_ref_eviction_strategy", "orders host leaves as upstream does"),
        *attribute_hooks(_COMP_BASE, "ComponentData", "value host_value lock_ref host_lock_ref",
                "reads a node's device locs, host slots and locks"),
        *attribute_hooks(_COMP_BASE, "ComponentData", "session_ref session_ids",
                "splits no host leaf a session protects"),
        *attribute_hooks(_TREE, "UnifiedTreeNode", "load_back_pending_id hash_value event_hash_value",
                "splits no host leaf being loaded or whose hashes do not match its pages"),
        *attribute_hooks(_COMP_BASE, "EvictLayer", "DEVICE", "tells device evictions from host ones"),
        *attribute_hooks(_TREE_IF, "DriveHostEvictionResult", "tracker device_frees host_frees cache_actions",
                "collects one host leaf's frees"),
        *attribute_hooks(_ALLOC_PI, "PageInterleavePoolAllocator", "class_free_page_counts class_free_pages "
                "class_release_pages need_sort debug_mode page_size shard_size free_group debug_check_classes",
                "reads the class counts and frees into the class lists as upstream's free does"),
        *attribute_hooks(_PH_PI, "PageInterleaveHostPool", "_slots", "reads the host slots' free pages per owner class"),
        *attribute_hooks(_ALLOC_PI, "PageInterleavePoolAllocator", "free_group_begin",
                "holds phase-known frees while a free group is open"),
        *attribute_hooks(_BPC, "InsertParams", "value rotation_base", "finds an insert's run and its rotation base"),
        *attribute_hooks(_ACTIONS, "FreeDeviceKV", "indices", "frees an insert's duplicates (slices of its value)"),
        *attribute_hooks(_URC, "UnifiedRadixCache", "req_to_token_pool", "finds a released request's row"),
        *attribute_hooks(_MEMPOOL, "ReqToTokenPool", "req_to_token", "finds a released request's row"),
        *attribute_hooks(_SB, "Req", "kv kv_rotation_base", "reads a released request's kv record and rotation base"),
        *attribute_hooks(_SB, "ReqKvInfo", "req_pool_idx holds_kv", "reads a released request's row"),
        *attribute_hooks(_PH_BASE, "HostKVCache", "shared_allocation_domain",
                "refuses a shared host allocation domain (another backup branch upstream)"),
        *attribute_hooks(_GROUP, "PoolEntry", "host_evict_fn", "refuses a host pool with its own eviction"),
    )


def _l3() -> tuple[Hook, ...]:
    """The library's L3: the lifted storage refusal, the scheduler's storage
    calls served on the cache instance, the pools' page bytes."""
    urc = "replaced-on-instance"
    return (
        Hook(_RES, None, "register_resolution_hook", "call", ("name",),
             "lifts the storage refusal of handle_kv_cache_sharding for the library's L3"),
        Hook(_RES, None, "_OVERRIDABLE_HOOKS", "attribute", None,
             "wraps handle_kv_cache_sharding, which must stay an overridable step"),
        Hook(_KSH, None, "handle_kv_cache_sharding", "call", ("server_args", "gpu_mem"),
             "runs upstream's sharding step with the storage backend hidden for its refusal only"),
        Hook(_MOB, None, "resolving_view", "call", ("server_args",), "reads the resolving flags"),
        Hook("sglang.srt.arg_groups.overrides", None, "declare_resolution", "call", ("server_args", "source", "fields"),
             "declares the storage backend unset for the sharding step and back to the user's value after it"),
        Hook(_MOB, None, "record_of", "call", ("view",), "finds the record under a resolution view"),
        Hook(_MOB, None, "ResolvingConfig", "attribute", None, "tells a view from a record"),
        Hook(_MOB, None, "ResolvedView", "attribute", None, "tells a view from a record"),
        Hook(_MC_UTILS, None, "get_hash_str", "call", ("token_ids", "prior_hash", "page_size"),
             "keys L3 pages by SGLang's page hash chain"),
        Hook(_RADIX, None, "RadixKey", "attribute", None, "builds the chain key of a restored node"),
        *attribute_hooks(_RADIX, "RadixKey", "token_ids extra_key cache_salt is_bigram",
                "keeps keys with an extra key, a cache salt or bigrams out of L3"),
        _urc("prefetch_from_storage", urc, (
            "self", "request", "last_host_node_id", "new_input_tokens", "last_hash", "prefix_keys",
            "matched_prefix_tokens", "extra_key", "cache_salt", "storage_hit_end"),
             "serves the scheduler's L3 lookup of an arriving request with the library's protocol"),
        _urc("check_prefetch_progress", urc, ("self", "request"), "holds a request while its L3 lookup is pending"),
        _urc("release_aborted_request", urc, ("self", "request"), "reports no span for an aborted request's lookup"),
        _urc("check_hicache_events", urc, ("self",),
             "settles the pending L3 lookups after each step's MIN; publishes the library's metrics"),
        _urc("_sync_hicache_ready_counts", urc, ("self",),
             "puts the pending lookups' words on the ready-ack all-reduce"),
        _urc("_all_reduce", urc, ("self", "data", "tp_reduce_op"), "carries the lookup words in the ready-ack MIN"),
        _urc("_finish_write_through_ack", urc, ("self", "ack_id"),
             "writes each rank's own pages of a node to L3 once its host copy is final"),
        _urc("reset", urc, ("self",), "drops the pending L3 lookups with the tree and host pools a flush clears"),
        _urc("clear_storage_backend", urc, ("self",),
             "clear_hicache_storage removes this deployment's CP L3 namespaces, alike on every rank"),
        _urc("_all_reduce_attn_groups", "private-helper", ("self", "tensor", "op"),
             "agrees on the lookup words when the ready-ack sync did not run"),
        _urc("inc_host_lock_ref", "call", ("self", "node_id"), "keeps a lookup's anchor on the host"),
        _urc("dec_host_lock_ref", "call", ("self", "node_id", "params"), "releases a lookup's anchor"),
        *attribute_hooks(_URC, "UnifiedRadixCache", "ongoing_write_through prefetch_loaded_tokens_by_reqid "
                "prefetch_loaded_storage_start_by_reqid prefetch_threshold",
                "finds a write ack's nodes and reports restored spans to the scheduler"),
        *attribute_hooks(_URC, "_OngoingWriteThrough", "publish_node_ids", "stores every node a write ack publishes"),
        _tree("insert_host", "call", ("self", "node_id", "key", "host_value", "hash_value"),
              "inserts the agreed pages as one host-only node"),
        _tree("node_by_id", "call", ("self", "node_id"), "resolves node ids"),
        *attribute_hooks(_TREE, "UnifiedTreeCore", "is_eagle", "keeps bigram keys out of L3"),
        *attribute_hooks(_TREE, "UnifiedTreeNode", "key write_through_pending_id",
                "hangs a chain only under a node whose host copy is final"),
        Hook(_TREE, "UnifiedTreeNode", "rotation_base", "replaced-on-instance", None,
             "reads a node's chain rotation and stamps the chain's base on a node inserted from L3"),
        *attribute_hooks(_BPC, "InsertResult", "inserted_host_node host_insert_dropped", "finds the inserted host node"),
        Hook(_BPC, "IncLockRefResult", "to_dec_params", "call", ("self",), "keeps the anchor lock's release"),
        _alloc("least_full_class", "call", ("self",),
               "starts a restored chain from the root on the least-full host class"),
        Hook(_GROUP, "HostPoolGroup", "alloc", "call", ("self", "need_size", "pool", "reclaim", "start_owner"),
             "takes logical host slots of the chain's owners"),
        Hook(_GROUP, "HostPoolGroup", "free", "call", ("self", "indices", "pool"),
             "gives back the slots past the agreed pages"),
        *page_byte_hooks(_PH_MLA, _PH_DSA),
        *attribute_hooks(_PH_MLA, "MLATokenToKVPoolHost", "kv_cache_dim layout", "sizes the L3 KV namespace"),
        *attribute_hooks(_PH_DSA, "DSAIndexerPoolHost", "indexer_page_stride_size", "sizes the L3 indexer namespace"),
        *attribute_hooks(_MEMPOOL, "KVCache", "start_layer", "puts the absolute layer range in the namespace"),
        # SGLang's storage metrics, fed from the CP L3 (--enable-metrics)
        _urc("_storage_attachment", "attribute", None,
             "reaches the attachment whose runtime config turns storage (and its metrics) on"),
        Hook("sglang.srt.mem_cache.unified_cache.storage_attachment", "StorageAttachment", "apply_runtime_config",
             urc, ("self", "storage_backend", "prefetch_threshold", "prefetch_timeout_base",
                   "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys", "enable_storage",
                   "enable_storage_metrics", "extra_metric_labels"),
             "runs upstream's with its own storage feeds off, then builds SGLang's storage collector for CP"),
        _urc("storage_metrics_collector", urc, None, "holds SGLang's storage collector, fed from the CP L3"),
        Hook(_METRICS, None, "StorageMetricsCollector", "attribute", None, "builds SGLang's storage collector"),
        Hook(_METRICS, None, "StorageMetrics", "attribute", None, "logs per-page L3 operations as SGLang's storage"),
        Hook(_METRICS, None, "STAT_LOGGER_ROLE_STORAGE", "attribute", None,
             "resolves the storage collector class as SGLang"),
        Hook(_METRICS, None, "resolve_collector_class", "call", ("role", "default_cls"),
             "resolves the storage collector class as SGLang"),
        Hook("sglang.srt.layers.dp_attention", None, "is_dp_attention_enabled", "call", (),
             "labels the storage metrics as SGLang under DP attention"),
        Hook("sglang.srt.runtime_context", None, "get_parallel", "call", (),
             "labels the storage metrics with this rank's TP / DP ranks"),
    )


#: Every hook, classes first (see the module doc).
HOOKS: tuple[Hook, ...] = _classes() + _seam() + _attributes() + _l3()


def check_hooks(hooks: tuple[Hook, ...] = HOOKS) -> None:
    """Raise :class:`HookMismatchError` naming the first hook that is missing
    or changed in the installed SGLang."""
    hook_registry.check_hooks(hooks, READ_FROM, "Set SGLANG_CP_HICACHE_COPY=upstream to keep SGLang's own stack.")
