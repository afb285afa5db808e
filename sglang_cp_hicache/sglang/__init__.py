"""SGLang-aware code: the only part of the package that imports sglang."""
