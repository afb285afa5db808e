"""The SGLang 0.5.23 suite runs only in the 0.5.23 environment (.venv-0523).

0.5.18 and 0.5.23 are one distribution name and cannot share a venv, so this
folder is collected only when the installed SGLang is 0.5.23 (``make
test-0523``); elsewhere it is left out and the run ends with a line saying so.

The multi-rank results are computed once per session: each launch starts
real rank processes (SGLang's runtime context is process-global) and runs
every scenario of its world size in them; the library's copies run on the
Triton kernels under the interpreter (``TRITON_INTERPRET=1`` in the ranks).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest

REQUIRED_SGLANG = "0.5.23"

try:
    _INSTALLED = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    _INSTALLED = None

if _INSTALLED != REQUIRED_SGLANG:
    collect_ignore_glob = ["test_*.py"]

    def pytest_terminal_summary(terminalreporter: Any) -> None:
        terminalreporter.write_line(
            f"tests/sglang_0523 not collected: it needs sglang=={REQUIRED_SGLANG} "
            f"(found {_INSTALLED}); run `make test-0523` (.venv-0523)"
        )

RANK_ENV = {"TRITON_INTERPRET": "1"}
SIM_REQUESTS = 40


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523 import scenarios
    from tests.helpers.sglang_0523.ranks import run_ranks

    return run_ranks(
        scenarios.two_rank_suite, 2, str(tmp_path_factory.mktemp("ranks2")), env=RANK_ENV,
        num_requests=SIM_REQUESTS,
    )


@pytest.fixture(scope="session")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.sglang_0523 import scenarios
    from tests.helpers.sglang_0523.ranks import run_ranks

    return run_ranks(
        scenarios.differential, 3, str(tmp_path_factory.mktemp("ranks3")), env=RANK_ENV,
        layouts=("page_first",),
    )


@pytest.fixture
def strategies():
    """SGLang's strategy list; restored afterwards, with the adapter's registration."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    from sglang_cp_hicache.sglang_0523 import strategy

    saved, saved_ours = list(assembler._STRATEGIES), strategy._strategy
    yield assembler._STRATEGIES
    assembler._STRATEGIES[:] = saved
    strategy._strategy = saved_ours
