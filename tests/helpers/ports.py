"""TCP ports for test servers, safe under pytest-xdist and concurrent runs.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range,
the same range every outgoing connection on the machine draws its local port
from (gloo opens many): between closing the probe socket and the server
binding the port, a connection elsewhere can take it. :func:`free_port`
instead walks a block of ports below the ephemeral range, one block per xdist
worker (``gw0``, ``gw1``, ...) of each part of the test command (``make
test`` runs its parts at once; ``CP_HICACHE_TEST_PART`` numbers them),
starting at an offset derived from the process id (two runs at once start
apart), never hands out a port twice in one process, and returns only a port
that binds right now.

Servers a test starts in another process (a store master, a gloo rendezvous)
take their port from here; in-process groups use ``dist.HashStore`` and
multi-process ones a ``file://`` store in the test's own tmp dir (no port).
"""

from __future__ import annotations

import itertools
import os
import socket

__all__ = ["free_port", "port_block", "worker_index"]

LOOPBACK = "127.0.0.1"
#: Ports per xdist worker (at most; fewer when parts x workers blocks of it
#: would reach the ephemeral range), and where the first block starts.
BLOCK = 500
FIRST = 20000
#: The parts of the test command that can run at once (make test).
PARTS = 3
PART_ENV = "CP_HICACHE_TEST_PART"

_counter = itertools.count()


def worker_index() -> int:
    """0 for ``gw0`` (and without xdist), 1 for ``gw1``, ..."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = name[2:] if name.startswith("gw") else ""
    return int(digits) if digits.isdigit() else 0


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _part() -> int:
    value = os.environ.get(PART_ENV, "0")
    return int(value) if value.isdigit() and int(value) < PARTS else 0


def port_block() -> tuple[int, int]:
    """(first port, ports) of this worker's block: one block per worker of
    every part, all of them below the ephemeral range."""
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), worker_index() + 1)
    blocks = PARTS * workers
    size = min(BLOCK, (_ephemeral_start() - FIRST) // blocks)
    if size < 20:
        raise RuntimeError(f"{blocks} port blocks do not fit below the ephemeral range; run fewer workers")
    return FIRST + (_part() * workers + worker_index()) * size, size


def free_port() -> int:
    """A TCP port on 127.0.0.1 that binds now, from this worker's own block."""
    start, size = port_block()
    offset = os.getpid() % size
    for _ in range(size):
        port = start + (offset + next(_counter)) % size
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue  # in use (another run, a server still closing)
            return port
    raise RuntimeError(f"no free port in {start}..{start + size - 1}")
