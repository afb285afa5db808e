"""Test-wide setup: hypothesis profiles, and SGLang importable on CPU where it
is installed.

Without a GPU, ``import torchvision`` fails (its PyPI wheel is a CUDA build);
the CPU harness registers its in-memory, import-only stand-in for this process
only then, so ``import sglang`` works. Nothing is installed on disk.

Where SGLang is not installed at all (a GPU machine with only torch and
triton), nothing SGLang-related is imported here: the kernel tests run, and a
test module that imports SGLang is reported as skipped with the reason,
instead of failing collection.
"""

import gc
import importlib.util
import logging
import os

import pytest
from hypothesis import HealthCheck, settings

from sglang_cp_hicache.sim.extensions import isolate_torch_extensions
from tests.helpers.cpu_slots import SlotGate
from tests.helpers.shared_fixtures import group_by_shared_fixtures, order_longest_modules_first

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Both suites run at once: each release JIT-builds SGLang's native hash extension in its own directory
# (same name, different sources), inherited by every process a test starts.
isolate_torch_extensions()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per pytest-xdist worker (and the processes it starts):
    # the workers already fill the cores, and intra-op threads waiting on a
    # busy core spin, burning CPU the other worker needs (measured: the 0.5.18
    # state machine took 155 CPU-s on 2 workers with torch's default threads).
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None
NO_SGLANG_REASON = "needs SGLang, which is not installed in this environment"

if SGLANG_INSTALLED:
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    ensure_sglang_importable()
    # SGLang logs a host-pool sizing warning for every small test pool.
    logging.getLogger("sglang").setLevel(logging.ERROR)


def _missing_sglang(longrepr: object) -> bool:
    # The import error pytest records for a module whose imports reach SGLang.
    text = str(longrepr)
    return "No module named 'sglang'" in text or "No module named 'sglang." in text


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """Without SGLang, a test module that fails to import ONLY because SGLang
    is missing is skipped with that reason; every other collection error
    still fails."""
    outcome = yield
    report = outcome.get_result()
    if not SGLANG_INSTALLED and report.failed and _missing_sglang(report.longrepr):
        path = str(getattr(collector, "path", collector.nodeid))
        report.outcome = "skipped"
        report.longrepr = (path, 0, f"Skipped: {NO_SGLANG_REASON}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``) the tests sharing a module-,
    class- or session-scoped fixture run on one worker, which builds it once.
    Modules with a ``slow`` test or a shared fixture come first in the
    collection, longest first, and the Makefile's ``--no-loadscope-reorder``
    makes xdist hand work out in that order: no long test starts last while
    the other workers have nothing left to do. Without xdist only the order
    of the modules changes; a module's tests keep their order."""
    group_by_shared_fixtures(items, os.path.dirname(__file__))
    order_longest_modules_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported so far (torch, SGLang, the test modules) lives as
    long as the process: out of the collector's reach, so that a full
    collection walks only what the tests allocate (a full collection over
    SGLang's imports takes 0.2-0.5 s and runs every few seconds)."""
    gc.collect()
    gc.freeze()


_SLOTS: "SlotGate | None" = None


def pytest_configure(config: pytest.Config) -> None:
    global _SLOTS
    _SLOTS = SlotGate.for_worker(config)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Under ``make test`` (its parts run at once) each test holds one of the
    machine's CPU slots (tests/helpers/cpu_slots.py); otherwise nothing."""
    if _SLOTS is None:
        yield
        return
    yield from _SLOTS.around(item, nextitem)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Unfrozen again before the interpreter finalizes: what stays frozen is
    never freed, and triton's nanobind bindings report it as leaked."""
    gc.unfreeze()
