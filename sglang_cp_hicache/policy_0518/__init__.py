"""Policy of the SGLang 0.5.18 adapter, in torch only (no sglang import):
what to copy and where, testable with plain integers.

``metadata`` (a node's owned positions and host slots), ``node_state`` (host
state on a tree node: set, split, clear), ``allocator`` (owner-lane paged
allocator with a CPU page mirror and an undo log), ``plan`` (the one write /
load planning path), ``host_eviction`` (the host ledger every rank mirrors and
eviction counted in physical slots), ``load_back`` (load-back by logical
length). The 0.5.18 adapter (``sglang_cp_hicache.sglang_0518``) is their only
production user; SGLang 0.5.23 keeps this bookkeeping itself.
"""
