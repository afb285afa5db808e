"""Context-parallel (CP shared KV) support for SGLang's hierarchical KV cache."""

from sglang_cp_hicache.layout import CpSharedKVLayout

__all__ = ["CpSharedKVLayout"]
__version__ = "0.1.0"
