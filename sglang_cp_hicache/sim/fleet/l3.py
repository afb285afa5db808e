"""A fleet's L3: what each deployment's ``--l3`` is, how big the store is
while the fleet runs, and (Mooncake) the masters the fleet started.

* ``--l3 DIR``: the file L3; ``--l3-scope deployment`` gives each deployment
  ``DIR/<name>``. Size: page objects and their bytes on disk.
* ``--l3 mooncake``: the fleet starts one ``mooncake_master`` on loopback
  (``--l3-scope deployment``: one per deployment, each deployment's store its
  own master and its own ranks' segments), every CP rank of every deployment
  opening its own client lending ``--mooncake-segment``; the masters are
  stopped at the end, their logs kept with the deployments' on a failure.
  Size: the objects (``master_key_count``) and bytes
  (``master_allocated_bytes``) the masters report, summed.
* ``--l3 mooncake://HOST:PORT``: a running master, fleet scope only (the
  fleet cannot start one per deployment there); its size is not sampled
  (the fleet does not know its metrics port).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_cp_hicache.sim.fleet.store_size import StoreSample, store_size
from sglang_cp_hicache.sim.mooncake_l3 import (
    DEFAULT_SEGMENT, OWN_CLUSTER, MasterProcess, is_mooncake, parse_master, parse_segment, start_master,
)

__all__ = ["FleetL3", "MasterRestart", "check_fleet_l3"]


@dataclass(frozen=True)
class MasterRestart:
    """A master killed and started again on its port while the fleet ran."""

    after_request: int  # the request released (and started) just before
    old_pid: int
    new_pid: int
    keys_before: Optional[int]  # objects the master held just before (forgotten with it)
    keys_after: Optional[int]
    # how long until every client had found the new master (None: not within the wait)
    clients_back_seconds: Optional[float]


def check_fleet_l3(l3: Optional[str], scope: str, segment: Optional[str]) -> Optional[str]:
    """Why ``--l3`` / ``--l3-scope`` / ``--mooncake-segment`` do not fit (None if they do)."""
    if l3 is None:
        if scope != "fleet":
            return "--l3-scope deployment needs --l3 DIR or --l3 mooncake"
        return "--mooncake-segment needs --l3 mooncake or --l3 mooncake://HOST:PORT" if segment else None
    try:
        if segment is not None:
            if not is_mooncake(l3):
                return "--mooncake-segment needs --l3 mooncake or --l3 mooncake://HOST:PORT"
            parse_segment(segment)
        if is_mooncake(l3) and l3 != OWN_CLUSTER:
            parse_master(l3)
            if scope != "fleet":
                return (f"--l3-scope deployment with --l3 {l3}: one running master is one store; use --l3 "
                        "mooncake (the fleet starts a master per deployment)")
    except ValueError as exc:
        return str(exc)
    if not is_mooncake(l3):
        from sglang_cp_hicache.sim.cli import _l3_problem

        return _l3_problem(l3)
    return None


@dataclass
class FleetL3:
    """The L3 the deployments use (None ``spec``: none)."""

    spec: Optional[str]
    scope: str
    segment: Optional[str] = None
    dirs: dict[str, str] = field(default_factory=dict)  # deployment name -> its file L3
    masters: dict[str, MasterProcess] = field(default_factory=dict)  # store name -> a master this fleet started
    store_of: dict[str, str] = field(default_factory=dict)  # deployment name -> its store's name
    restarts: list[MasterRestart] = field(default_factory=list)
    capacity_bytes: int = 0  # the most segment memory the masters reported mounted (Mooncake)

    @property
    def mooncake(self) -> bool:
        return is_mooncake(self.spec)

    @property
    def label(self) -> Optional[str]:
        if self.spec is None or self.mooncake:
            return self.spec
        return os.path.abspath(self.spec)

    def open(self, names: list[str], workdir: str) -> None:
        """Name each deployment's store; start the masters a ``--l3 mooncake`` fleet needs."""
        for name in names:
            store = "fleet" if self.scope == "fleet" else name
            self.store_of[name] = store
            if self.spec is not None and not self.mooncake:
                self.dirs[name] = os.path.abspath(self.spec if store == "fleet" else os.path.join(self.spec, store))
        if self.spec == OWN_CLUSTER:
            for store in sorted(set(self.store_of.values())):
                self.masters[store] = start_master(workdir, f"mooncake_master-{store}")

    def flags(self, name: str) -> list[str]:
        """The deployment's ``simulate`` flags for its L3."""
        if self.spec is None:
            return []
        if not self.mooncake:
            return ["--l3", self.dirs[name]]
        master = self.masters.get(self.store_of[name])
        target = f"mooncake://{master.address}" if master is not None else self.spec
        return ["--l3", target, "--mooncake-segment", self.segment or DEFAULT_SEGMENT]

    def where(self, name: str) -> Optional[str]:
        """Where a deployment's L3 is, for its report."""
        if self.spec is None:
            return None
        if not self.mooncake:
            return self.dirs[name]
        master = self.masters.get(self.store_of[name])
        return f"mooncake://{master.address}" if master is not None else self.spec

    def sample(self, requests: int, seconds: float) -> StoreSample:
        if not self.mooncake:
            return store_size(sorted(set(self.dirs.values())), requests, seconds)
        objects = size = capacity = 0
        for master in self.masters.values():
            m = master.metrics()
            objects += int(m.get("master_key_count", 0))
            size += int(m.get("master_allocated_bytes", 0))
            capacity += int(m.get("master_total_capacity_bytes", 0))
        self.capacity_bytes = max(self.capacity_bytes, capacity)
        return StoreSample(requests, round(seconds, 3), objects, size)

    def restart_master(self, after_request: int, clients: int, wait_s: float = 60.0) -> MasterRestart:
        """Kill the (fleet scope) master, start it again on its port, and wait
        (at most ``wait_s``) until its ``clients`` have reconnected to it, so
        the rest of the run shows the store working again."""
        master = self.masters["fleet"]
        before = master.metrics().get("master_key_count")
        old, new = master.restart()
        after = master.metrics().get("master_key_count")
        t0 = time.monotonic()
        back: Optional[float] = None
        while back is None and time.monotonic() - t0 < wait_s:
            if master.metrics().get("master_active_clients", 0) >= clients:
                back = round(time.monotonic() - t0, 3)
            else:
                time.sleep(0.1)
        record = MasterRestart(after_request, old, new, None if before is None else int(before),
                               None if after is None else int(after), back)
        self.restarts.append(record)
        return record

    def stop(self) -> None:
        for master in self.masters.values():
            master.stop()

    def as_dict(self) -> Optional[dict[str, Any]]:
        """The report's Mooncake facts (None for a file L3 or none)."""
        if not self.mooncake:
            return None
        return {
            "own_masters": {store: {"address": m.address, "log": str(m.log), "starts": m.starts, "pid": m.pid}
                            for store, m in self.masters.items()},
            "external_master": None if self.masters else parse_master(self.spec or ""),
            "segment_bytes_per_rank": parse_segment(self.segment or DEFAULT_SEGMENT),
            "store_size_measures": "objects: master_key_count, bytes: master_allocated_bytes (the masters' metrics)"
                                   if self.masters else "not sampled (a running master's metrics port is unknown)",
            "capacity_bytes": self.capacity_bytes,
            "master_restarts": [vars(r) for r in self.restarts],
        }
