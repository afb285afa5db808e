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
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setenv(ports.PART_ENV, "2")
    start, size = ports.port_block()
    assert (start, size) == (ports.FIRST + (2 * 4 + 3) * ports.BLOCK, ports.BLOCK)
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20 and all(start <= p < start + size for p in got)
    with socket.socket() as held:  # a port in use is skipped
        held.bind((ports.LOOPBACK, got[-1] + 1 if got[-1] + 1 < start + size else start))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in [ports.free_port() for _ in range(size - 21)]


def test_every_worker_of_every_part_gets_its_own_port_block(monkeypatch):
    # 3 parts x 32 workers: the blocks shrink to fit below the ephemeral range, never overlap
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "32")
    spans = []
    for part in range(ports.PARTS):
        for worker in range(32):
            monkeypatch.setenv(ports.PART_ENV, str(part))
            monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
            start, size = ports.port_block()
            spans.append((start, start + size))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[0][0] == ports.FIRST and spans[-1][1] <= ports._ephemeral_start()


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


# ---- the CPU slots make test's concurrent parts share ----------------------------------


class _Item:
    """A stand-in for a pytest item: only its xdist_group and waits marks are read."""

    def __init__(self, group, waits=False):
        self.group = group
        self.waits = waits

    def get_closest_marker(self, name):
        if name == "waits":
            return pytest.mark.waits.mark if self.waits else None
        return pytest.mark.xdist_group(self.group).mark if self.group is not None else None


def _run_around(gate, item, nextitem, seen):
    wrapper = gate.around(item, nextitem)
    next(wrapper)
    seen.append(gate.held)
    with pytest.raises(StopIteration):
        wrapper.send(None)


def test_no_more_tests_hold_a_slot_than_there_are_slots(tmp_path):
    import threading
    import time

    from tests.helpers.cpu_slots import SlotGate

    gates = [SlotGate(str(tmp_path), 2) for _ in range(3)]
    for gate in gates[:2]:
        gate.acquire()
    third = threading.Thread(target=gates[2].acquire)
    third.start()
    time.sleep(0.3)
    assert third.is_alive() and not gates[2].held  # both slots are taken: the third waits
    gates[0].release()
    third.join(5)
    assert not third.is_alive() and gates[2].held and gates[2].waited_s >= 0.25
    for gate in gates[1:]:
        gate.release()


def test_a_worker_keeps_its_slot_across_one_group_and_only_there(tmp_path):
    from tests.helpers.cpu_slots import SlotGate

    gate, other = SlotGate(str(tmp_path), 1), SlotGate(str(tmp_path), 1)
    seen: list[bool] = []
    _run_around(gate, _Item("fixture-a"), _Item("fixture-a"), seen)
    assert gate.held  # the next test shares the fixture: the slot stays
    _run_around(gate, _Item("fixture-a"), _Item(None), seen)
    assert not gate.held
    _run_around(gate, _Item(None), _Item(None), seen)  # ungrouped: released after each test
    assert not gate.held
    _run_around(gate, _Item("fixture-b"), None, seen)  # the worker's last test
    assert not gate.held and seen == [True] * 4
    other.acquire()  # nothing is left holding the one slot
    assert other.held
    other.release()


def test_a_waiting_test_runs_without_a_slot_and_a_held_slot_is_kept(tmp_path):
    import threading

    from tests.helpers.cpu_slots import SlotGate

    busy, gate = SlotGate(str(tmp_path), 1), SlotGate(str(tmp_path), 1)
    busy.acquire()  # the only slot is taken: an unmarked test would block here
    seen: list[bool] = []
    marked = threading.Thread(target=_run_around, args=(gate, _Item(None, waits=True), _Item(None), seen),
                              daemon=True)
    marked.start()
    marked.join(5)
    assert not marked.is_alive() and seen == [False] and not gate.held
    busy.release()
    _run_around(gate, _Item("fixture-a"), _Item("fixture-a", waits=True), seen)
    assert gate.held  # kept for the next test of its group, marked or not
    _run_around(gate, _Item("fixture-a", waits=True), _Item(None), seen)
    assert seen == [False, True, True] and not gate.held


def test_only_an_xdist_worker_is_gated_and_its_children_are_not(monkeypatch, tmp_path):
    import os
    import types

    from tests.helpers.cpu_slots import ENV, SlotGate

    monkeypatch.setenv(ENV, str(tmp_path))
    controller = types.SimpleNamespace()
    assert SlotGate.for_worker(controller) is None and os.environ[ENV] == str(tmp_path)  # workers inherit it
    gate = SlotGate.for_worker(types.SimpleNamespace(workerinput={"workercount": 2}))
    assert gate is not None and gate.count == 2 and gate.directory == str(tmp_path)
    assert ENV not in os.environ  # a pytest a test starts waits for no slot
