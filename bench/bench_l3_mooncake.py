"""L3 on a real Mooncake store: the copy-free path against the copying path,
in one run.

Usage: python bench/bench_l3_mooncake.py [--pages 48] [--out FILE.json]

Starts ``mooncake_master`` on loopback (TCP, peer-to-peer handshake, the
package's own binary), opens a writer and a reader client (16 MiB staging
buffer, SGLang's default), and moves ``--pages`` DeepSeek-V3.2 KV pages
(2,561,024 B) both ways on both paths, every page verified on read:

* copying: ``put`` of the packed object (header + page joined into one
  bytes) and ``get`` into Python bytes, verified there, copied into the
  reader's page buffer;
* copy-free: ``write_from`` (header and page sent as the parts of one
  object) and ``read_into`` the reader's registered buffers (header and
  page in one transfer, in place), verified there.

Without ``--out`` it writes a new file under ``build/bench-results/``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from sglang_cp_hicache.l3.envelope import HEADER_BYTES, byte_view, check_object, header, pack
from sglang_cp_hicache.l3.keys import L3Namespace, page_keys
from sglang_cp_hicache.l3_backends.mooncake import MooncakeConfig, MooncakePageStore

from bench_paths import out_path

LOOPBACK = "127.0.0.1"


def _port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _master(workdir: Path) -> tuple[subprocess.Popen, int]:
    import mooncake

    binary = next(Path(d) / "mooncake_master" for d in mooncake.__path__ if (Path(d) / "mooncake_master").is_file())
    rpc = _port()
    proc = subprocess.Popen([str(binary), f"--rpc_port={rpc}", f"--rpc_address={LOOPBACK}", f"--metrics_port={_port()}",
                             f"--metrics_host={LOOPBACK}", "--enable_metric_reporting=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((LOOPBACK, rpc), timeout=0.5).close()
            return proc, rpc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("mooncake_master did not start")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ns = L3Namespace(model_id="bench", kv_dtype="uint8", row_bytes=656, page_size=64, pool="kv", layer_start=0,
                     layer_end=61)
    pages = [torch.randint(0, 256, (ns.page_bytes,), dtype=torch.uint8) for _ in range(args.pages)]
    total = args.pages * ns.page_bytes
    size = HEADER_BYTES + ns.page_bytes
    workdir = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    proc, rpc = _master(workdir)
    try:
        def client() -> MooncakePageStore:
            return MooncakePageStore(MooncakeConfig(
                master_server_address=f"{LOOPBACK}:{rpc}", local_hostname=LOOPBACK, protocol="tcp",
                global_segment_size=(2 * total + (64 << 20)), local_buffer_size=16 << 20))

        writer, reader = client(), client()
        head, page = bytearray(HEADER_BYTES), torch.empty(ns.page_bytes, dtype=torch.uint8)
        views = [memoryview(head), byte_view(page)]
        assert reader.register_buffers(views)
        out: dict = {"command": f"python bench/bench_l3_mooncake.py --pages {args.pages}", "pages": args.pages,
                     "page_bytes": ns.page_bytes, "local_buffer_size": 16 << 20}
        for path, seed in (("copying", 1), ("copy_free", 2)):
            keys = page_keys([f"{seed:016x}{i:048x}" for i in range(args.pages)], ns)
            t = time.perf_counter()
            for key, data in zip(keys, pages):
                if path == "copying":
                    assert writer.put([key], [pack(key, ns, data)]) == [True]
                else:
                    assert writer.write_from(key, [memoryview(header(key, ns, data)), byte_view(data)])
            out[f"{path}_write_GBps"] = round(total / (time.perf_counter() - t) / 1e9, 3)
            t = time.perf_counter()
            for key, data in zip(keys, pages):
                if path == "copying":
                    blob = memoryview(reader.get([key], [size])[0])
                    assert check_object(key, ns, blob[:HEADER_BYTES], blob[HEADER_BYTES:]) is None
                    views[1][:] = blob[HEADER_BYTES:]
                else:
                    assert reader.read_into(key, size, views) == size
                    assert check_object(key, ns, views[0], views[1]) is None
            out[f"{path}_read_GBps"] = round(total / (time.perf_counter() - t) / 1e9, 3)
            assert torch.equal(page, pages[-1])
        out["copy_free_over_copying_read"] = round(out["copy_free_read_GBps"] / out["copying_read_GBps"], 3)
        out["copy_free_over_copying_write"] = round(out["copy_free_write_GBps"] / out["copying_write_GBps"], 3)
        writer.close()
        reader.close()
    finally:
        proc.terminate()
        proc.wait(10)
    target = Path(out_path(args.out, "l3_mooncake", ".json"))
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
