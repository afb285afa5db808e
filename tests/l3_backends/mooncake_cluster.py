"""A real Mooncake store on loopback for the tests: ``mooncake_master``
(shipped in the mooncake wheel) on free ports, optionally with its HTTP
metadata server, and clients opened through :class:`MooncakePageStore`."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sglang_cp_hicache.l3_backends.mooncake import MooncakeConfig, MooncakePageStore
from tests.helpers.ports import free_port

LOOPBACK = "127.0.0.1"


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            socket.create_connection((LOOPBACK, port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mooncake_master did not listen on {port} within {timeout} s:\n{log.read_text()[-4000:]}")


@dataclass
class MooncakeCluster:
    """One master; ``open_store`` adds a client (one per simulated rank)."""

    master: subprocess.Popen
    rpc_port: int
    metadata_server: str
    log: Path
    stores: list[MooncakePageStore] = field(default_factory=list)

    def config(self, **overrides) -> MooncakeConfig:
        fields = dict(master_server_address=f"{LOOPBACK}:{self.rpc_port}", metadata_server=self.metadata_server,
                      local_hostname=LOOPBACK, protocol="tcp", global_segment_size=16 << 20,
                      local_buffer_size=16 << 20)
        fields.update(overrides)
        return MooncakeConfig(**fields)

    def open_store(self, **overrides) -> MooncakePageStore:
        store = MooncakePageStore(self.config(**overrides))
        self.stores.append(store)
        return store

    def stop(self) -> None:
        try:
            for store in self.stores:
                store.close()
        finally:
            self._stop_master()

    def _stop_master(self) -> None:
        self.master.terminate()
        try:
            self.master.wait(10)
        except subprocess.TimeoutExpired:
            self.master.kill()
            self.master.wait(10)


def start_cluster(master_binary: Path, workdir: Path, *, http_metadata: bool) -> MooncakeCluster:
    rpc, metrics = free_port(), free_port()
    args = [str(master_binary), f"--rpc_port={rpc}", f"--rpc_address={LOOPBACK}", f"--metrics_port={metrics}",
            f"--metrics_host={LOOPBACK}", "--enable_metric_reporting=false"]
    metadata, http = "P2PHANDSHAKE", None
    if http_metadata:
        http = free_port()
        args += ["--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                 f"--http_metadata_server_host={LOOPBACK}"]
        metadata = f"http://{LOOPBACK}:{http}/metadata"
    log = workdir / "mooncake_master.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        for port in (rpc,) if http is None else (rpc, http):
            _wait_for_port(port, proc, log)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return MooncakeCluster(proc, rpc, metadata, log)


def master_binary() -> Optional[Path]:
    """``mooncake_master`` from the installed mooncake package."""
    import mooncake

    for directory in mooncake.__path__:
        path = Path(directory) / "mooncake_master"
        if path.is_file():
            return path
    return None
