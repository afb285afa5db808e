"""Test-wide setup: import paths and hypothesis profiles.

``tests/stubs`` holds a torchvision stand-in so SGLang imports on CPU-only
machines; it exists only in the test tree, never in a user's environment.
"""

import os
import sys

from hypothesis import HealthCheck, settings

_HERE = os.path.dirname(os.path.abspath(__file__))
for path in (_HERE, os.path.join(_HERE, "stubs")):
    if path not in sys.path:
        sys.path.insert(0, path)

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# SGLang logs a host-pool sizing warning for every small test pool.
import logging  # noqa: E402

logging.getLogger("sglang").setLevel(logging.ERROR)
