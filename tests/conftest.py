"""Test-wide setup: hypothesis profiles, and SGLang importable on CPU.

Without a GPU, ``import torchvision`` fails (its PyPI wheel is a CUDA build);
the CPU harness registers its in-memory, import-only stand-in for this process
only then, so ``import sglang`` works. Nothing is installed on disk.
"""

import logging
import os

from hypothesis import HealthCheck, settings

from sglang_cp_hicache.testing.cpu_support import ensure_sglang_importable

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ensure_sglang_importable()

# SGLang logs a host-pool sizing warning for every small test pool.
logging.getLogger("sglang").setLevel(logging.ERROR)
