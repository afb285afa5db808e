"""The simulator's Mooncake L3: ``--l3 mooncake://HOST:PORT`` (a running
``mooncake_master``) and, for a fleet, ``--l3 mooncake`` (a master the fleet
starts on loopback and stops at the end).

Every CP rank opens its own client through the library's Mooncake page
store, as a server rank does (``--hicache-storage-backend mooncake`` with
the extra config built here): it lends ``--mooncake-segment`` bytes of its
memory to the store (its *segment*; Mooncake places each object in some
client's segment) over TCP, with the P2P handshake (no metadata server).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_cp_hicache.l3_backends.mooncake import MIN_SEGMENT_BYTES
from sglang_cp_hicache.testing.lifetime import end_process, set_parent_death_signal
from sglang_cp_hicache.sizes import parse_mooncake_size

__all__ = ["DEFAULT_SEGMENT", "LOOPBACK", "MOONCAKE_SCHEME", "MasterProcess", "OWN_CLUSTER", "extra_config",
           "master_binary", "mooncake_missing", "parse_master", "parse_segment"]

MOONCAKE_SCHEME = "mooncake://"
#: ``fleet --l3 mooncake``: the fleet starts its own master.
OWN_CLUSTER = "mooncake"
LOOPBACK = "127.0.0.1"
#: Per client (CP rank): what one rank lends the store unless --mooncake-segment says otherwise.
DEFAULT_SEGMENT = "64mb"
#: The check a deployment's interpreter runs: can it open a Mooncake client?
_IMPORT_CHECK = "import mooncake.store"


def is_mooncake(l3: Optional[str]) -> bool:
    return l3 is not None and (l3 == OWN_CLUSTER or l3.startswith(MOONCAKE_SCHEME))


def parse_master(text: str, flag: str = "--l3") -> str:
    """``mooncake://HOST:PORT`` -> ``HOST:PORT``; ValueError naming ``flag``."""
    address = text[len(MOONCAKE_SCHEME):] if text.startswith(MOONCAKE_SCHEME) else ""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in address:
        raise ValueError(f"{flag} {text}: expected mooncake://HOST:PORT, the RPC address of a running "
                         "mooncake_master")
    return address


def parse_segment(text: str) -> int:
    """``--mooncake-segment``: bytes per client, at least Mooncake's minimum."""
    try:
        return parse_mooncake_size("--mooncake-segment", text.strip(), MIN_SEGMENT_BYTES)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{exc} (per CP rank: '64mb', '1gb' or bytes; Mooncake mounts no segment below "
                         f"{MIN_SEGMENT_BYTES >> 20} MiB)") from None


def extra_config(master: str, segment_bytes: int, segment_ranks: int) -> str:
    """The ``--hicache-storage-backend-extra-config`` of one rank: its client
    on ``master`` lending ``segment_bytes``. SGLang's ``global_segment_size``
    is a TP group's, each rank mounting its share: ``segment_ranks`` (the
    ranks it is divided by in this stack) times the per-rank segment."""
    return json.dumps({
        "master_server_address": master, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "local_hostname": LOOPBACK, "global_segment_size": segment_bytes * segment_ranks,
    })


def mooncake_missing(python: str) -> Optional[str]:
    """Why ``python`` cannot open a Mooncake client (None if it can)."""
    proc = subprocess.run([python, "-c", _IMPORT_CHECK], capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"{python} cannot import mooncake.store ({last}): install the mooncake wheel "
            "(mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA) in that environment")


def master_binary() -> Optional[Path]:
    """``mooncake_master`` from the mooncake package of this interpreter."""
    try:
        import mooncake
    except ImportError:
        return None
    for directory in mooncake.__path__:
        path = Path(directory) / "mooncake_master"
        if path.is_file():
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), 0.2).close()
        return True
    except OSError:
        return False


@dataclass
class MasterProcess:
    """One ``mooncake_master`` on loopback; its RPC and metrics ports stay
    the same across :meth:`restart` (clients reconnect to the same address)."""

    binary: Path
    log: Path
    rpc_port: int = 0
    metrics_port: int = 0
    proc: Optional[subprocess.Popen] = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it (fresh ports the first time) and wait until both ports answer."""
        if not self.rpc_port:
            self.rpc_port, self.metrics_port = _free_port(), _free_port()
        args = [str(self.binary), f"--rpc_port={self.rpc_port}", f"--rpc_address={LOOPBACK}",
                f"--metrics_port={self.metrics_port}", f"--metrics_host={LOOPBACK}",
                "--enable_metric_reporting=false"]
        with open(self.log, "ab") as out:
            out.write(f"--- start {self.starts + 1}: {' '.join(args)}\n".encode())
            out.flush()
            # it dies with the process that started it, even one SIGKILLed before it could stop it
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.log.parent, preexec_fn=set_parent_death_signal)
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while not (_listening(self.rpc_port) and _listening(self.metrics_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start on {self.address} (log: {self.log}): "
                                   + self.log.read_text(errors="replace")[-2000:])
            time.sleep(0.05)

    def restart(self) -> tuple[int, int]:
        """SIGKILL it (every object it knew of is forgotten) and start it again
        on the same ports; the (old, new) pids."""
        old = self.pid
        assert self.proc is not None and old is not None
        self.proc.kill()
        self.proc.wait()
        deadline = time.monotonic() + 30.0
        while _listening(self.rpc_port) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.start()
        assert self.pid is not None
        return old, self.pid

    def stop(self) -> None:
        if self.proc is not None:
            end_process(self.proc)

    def metrics(self) -> dict[str, float]:
        """The master's gauges and counters (``/metrics``, Prometheus text); empty when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line.startswith("master_") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out


def start_master(workdir: str, name: str = "mooncake_master") -> MasterProcess:
    """A master on free loopback ports, logging to ``workdir/<name>.log``."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError("no mooncake_master: the mooncake wheel is not installed in this environment")
    master = MasterProcess(binary, Path(os.path.join(workdir, f"{name}.log")))
    master.start()
    return master
