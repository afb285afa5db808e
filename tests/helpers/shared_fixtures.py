"""Keep the tests that share an expensive fixture on one pytest-xdist worker.

A module-, class- or session-scoped fixture is built once per worker process
that needs it: if pytest-xdist spread its tests over two workers, both would
build it (start its rank processes, run its simulation) -- twice the CPU for
the same result. :func:`group_by_shared_fixtures` gives every test that uses
such a fixture (one defined under ``tests/``, not pytest's own such as
``tmp_path_factory``) an ``xdist_group`` mark; tests that share one fixture
instance, directly or through a chain of them, get the same group name, so
``--dist loadgroup`` sends them to one worker as a unit. A test that already
carries an ``xdist_group`` mark keeps it.

Without xdist (or with another ``--dist``) the marks change nothing.
"""

from __future__ import annotations

import os
from typing import Iterable

import pytest

__all__ = ["SHARED_FIXTURE_SECONDS", "group_by_shared_fixtures", "order_longest_modules_first"]

#: What a module using a shared fixture counts as (seconds on 2 idle cores)
#: when :func:`order_longest_modules_first` sorts it: such fixtures start
#: processes or build stacks, by convention.
SHARED_FIXTURE_SECONDS = 30.0


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # the smaller name wins: the group name does not depend on test order
            self.parent[max(ra, rb)] = min(ra, rb)


def _instance_keys(item: pytest.Item, tests_dir: str) -> Iterable[str]:
    """One key per shared fixture instance ``item`` uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name in info.names_closure:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            scope = fixturedef.scope
            if scope == "function":
                continue
            func = getattr(fixturedef, "func", None)
            source = os.path.abspath(getattr(getattr(func, "__code__", None), "co_filename", ""))
            if not source.startswith(tests_dir):
                continue  # pytest's or a plugin's fixture: cheap, or not ours to group
            if scope == "session":
                yield f"session:{name} in {os.path.relpath(source, tests_dir)}"
            elif scope == "package":
                yield f"package:{name} in {os.path.dirname(item.nodeid.split('::')[0])}"
            elif scope == "module":
                yield f"module:{item.nodeid.split('::')[0]}"
            else:  # class
                parts = item.nodeid.split("::")
                yield f"class:{'::'.join(parts[:-1])}"


def group_by_shared_fixtures(items: list[pytest.Item], tests_dir: str) -> None:
    """Add ``xdist_group(<shared fixture instance>)`` to every test that uses one."""
    tests_dir = os.path.abspath(tests_dir) + os.sep
    sets = _UnionFind()
    keys_of: dict[int, list[str]] = {}
    for index, item in enumerate(items):
        if any(True for _ in item.iter_markers("xdist_group")):
            continue
        keys = sorted(set(_instance_keys(item, tests_dir)))
        if not keys:
            continue
        keys_of[index] = keys
        for key in keys[1:]:
            sets.union(keys[0], key)
    for index, keys in keys_of.items():
        # xdist reads the group after the node id's last "@"; "]" ends a parameter id
        name = sets.find(keys[0]).replace("@", "_").replace("]", "_")
        items[index].add_marker(pytest.mark.xdist_group(name))


def _seconds(item: pytest.Item) -> float:
    """``slow(seconds)``'s estimate (30 without one), or 0 for a test without the mark."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return SHARED_FIXTURE_SECONDS if item.get_closest_marker("xdist_group") else 0.0
    return float(mark.args[0]) if mark.args else 30.0


def order_longest_modules_first(items: list[pytest.Item]) -> None:
    """Sort the modules by their longest test (``slow`` mark or shared
    fixture), longest first; stable, so the rest keep their order, and so
    do the tests within a module."""
    longest: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        longest[module] = max(longest.get(module, 0.0), _seconds(item))
    items.sort(key=lambda item: -longest[item.nodeid.split("::")[0]])
