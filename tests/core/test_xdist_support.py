"""The test-suite machinery that keeps pytest-xdist runs correct and short:
shared fixtures pin their tests to one worker, slow modules go first, and
server ports come from the worker's own block."""

from __future__ import annotations

import socket

import pytest

from tests.helpers import ports

pytest_plugins = ["pytester"]

CONFTEST = """
import os
from tests.helpers.shared_fixtures import group_by_shared_fixtures, order_longest_modules_first

def pytest_collection_modifyitems(config, items):
    group_by_shared_fixtures(items, os.path.dirname(__file__))
    order_longest_modules_first(items)
    for item in items:
        groups = [m.args[0] for m in item.iter_markers("xdist_group")]
        print("ITEM", item.nodeid, "|".join(groups))
"""


def _collect(pytester: pytest.Pytester) -> list[tuple[str, str]]:
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-s", "-p", "no:xdist", "-p", "no:cacheprovider")
    rows = [line.split(" ", 2)[1:] for line in result.outlines if line.startswith("ITEM ")]
    return [(row[0], row[1] if len(row) > 1 else "") for row in rows]


def test_tests_sharing_a_fixture_instance_get_one_group_and_go_first(pytester, monkeypatch):
    import tests

    monkeypatch.syspath_prepend(str(pytester.path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(tests.__file__).parents[1]))
    pytester.makepyfile(
        test_a_plain="def test_plain(): pass\n",
        test_b_module="""
import pytest

@pytest.fixture(scope="module")
def built():
    return 1

def test_one(built): pass
def test_two(built): pass
def test_alone(tmp_path_factory): pass
""",
        test_c_slow="""
import pytest

@pytest.mark.slow(90)
def test_long(): pass
def test_short(): pass
""",
        test_d_session="""
import pytest

@pytest.fixture(scope="session")
def launch():
    return 2

@pytest.fixture(scope="module")
def view(launch):
    return launch

def test_direct(launch): pass
def test_chained(view): pass
""",
    )
    items = _collect(pytester)
    order = [nodeid for nodeid, _ in items]
    groups = dict(items)
    # the slow module first, then the modules with shared fixtures, the rest in collection order
    assert order[:2] == ["test_c_slow.py::test_long", "test_c_slow.py::test_short"]
    assert order[-1] == "test_a_plain.py::test_plain"
    assert groups["test_b_module.py::test_one"] == groups["test_b_module.py::test_two"] != ""
    # pytest's own session fixtures do not group; one session instance joins two modules' tests
    assert groups["test_b_module.py::test_alone"] == ""
    assert groups["test_d_session.py::test_direct"] == groups["test_d_session.py::test_chained"] != ""
    assert groups["test_d_session.py::test_direct"] != groups["test_b_module.py::test_one"]
    assert all("@" not in g and "]" not in g for g in groups.values())


def test_free_ports_are_distinct_bindable_and_in_the_workers_block(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    start = ports.FIRST + 3 * ports.BLOCK
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20 and all(start <= p < start + ports.BLOCK for p in got)
    with socket.socket() as held:  # a port in use is skipped
        held.bind((ports.LOOPBACK, got[-1] + 1 if got[-1] + 1 < start + ports.BLOCK else start))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in [ports.free_port() for _ in range(ports.BLOCK - 21)]


def test_installed_xdist_runs_a_group_on_one_worker(pytester):
    # The marks are worth nothing if the installed pytest-xdist cannot act on
    # them (pytest 9 with pytest-xdist 3.8 drops the group suffix silently):
    # eight tests of one group, two workers, one worker runs them all.
    pytest.importorskip("xdist")
    pytester.makepyfile(
        test_grouped="""
import os, pytest
pytestmark = pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(8))
def test_where(i):
    print("WORKER", os.environ["PYTEST_XDIST_WORKER"])
"""
    )
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=8)
    workers = {line.split()[1] for line in result.outlines if line.startswith("WORKER ")}
    assert len(workers) == 1, workers
