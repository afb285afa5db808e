"""TCP ports for test servers, safe under pytest-xdist and concurrent runs.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range,
the same range every outgoing connection on the machine draws its local port
from (gloo opens many): between closing the probe socket and the server
binding the port, a connection elsewhere can take it. :func:`free_port`
instead walks a block of ports below the ephemeral range, one block per xdist
worker (``gw0``, ``gw1``, ...), starting at an offset derived from the process
id (two runs at once start apart), never hands out a port twice in one
process, and returns only a port that binds right now.

Servers a test starts in another process (a store master, a gloo rendezvous)
take their port from here; in-process groups use ``dist.HashStore`` and
multi-process ones a ``file://`` store in the test's own tmp dir (no port).
"""

from __future__ import annotations

import itertools
import os
import socket

__all__ = ["free_port", "worker_index"]

LOOPBACK = "127.0.0.1"
#: Ports per xdist worker, and where the first block starts: 24 workers fit
#: below 32768, Linux's default start of the ephemeral range.
BLOCK = 500
FIRST = 20000

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that binds now, from this worker's own block."""
    start = FIRST + worker_index() * BLOCK
    if start + BLOCK > _ephemeral_start():
        raise RuntimeError(
            f"xdist worker {worker_index()} has no port block below the ephemeral range; run fewer workers"
        )
    offset = os.getpid() % BLOCK
    for _ in range(BLOCK):
        port = start + (offset + next(_counter)) % BLOCK
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue  # in use (another run, a server still closing)
            return port
    raise RuntimeError(f"no free port in {start}..{start + BLOCK - 1}")
