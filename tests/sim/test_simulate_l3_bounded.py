"""``simulate --l3 DIR`` with SGLang's ``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE``
well below what the run writes: sampled all along, the directory never holds
more than the cap plus one object per writer thread; a reader of it restores
only bit-exact pages. (The hit rates against an eviction of random chains
are measured in bench/bench_l3_bound.py.)"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Optional

import pytest

from sglang_cp_hicache.l3.envelope import HEADER_BYTES
from sglang_cp_hicache.sim.l3_usage import peak_stored_bytes, stored_bytes

from tests.sim.simrun import simulate

REQUESTS = 40
CP4 = ("--cp-size", "4", "--device-pages", "16", "--host-pages", "8")
CP2 = ("--cp-size", "2", "--device-pages", "32", "--host-pages", "16")
#: The sim's pages: 2 layers x 64 tokens (KV 576 B rows, indexer 132 B) + the header.
KV_OBJECT = HEADER_BYTES + 2 * 64 * 576
PAGE_OBJECTS = KV_OBJECT + HEADER_BYTES + 2 * 64 * 132
CAP = 40 * PAGE_OBJECTS  # an unbounded CP 4 run of these requests writes about 110 pages
THREADS = 2


class _Running:
    """What :func:`peak_stored_bytes` polls: None while the run's thread lives."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def poll(self) -> Optional[int]:
        return None if self.thread.is_alive() else 0


def run_sampled(shape: tuple[str, ...], l3: Path, out: Path) -> tuple[dict, int]:
    env = {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": str(CAP), "SGLANG_CP_HICACHE_L3_THREADS": str(THREADS)}
    done: list = []
    # the run in a thread of this process (its ranks from the worker's shared zygote), sampled from this one
    thread = threading.Thread(target=lambda: done.append(simulate(
        *shape, "--requests", str(REQUESTS), "--l3", str(l3), "--json", str(out), env=env, timeout=600)[0]))
    thread.start()
    peak = peak_stored_bytes(_Running(thread), l3)
    thread.join()
    assert done and done[0].returncode == 0, done and done[0].stdout + done[0].stderr
    return json.loads(out.read_text()), max(peak, stored_bytes(l3))


@pytest.mark.slow(40)
def test_a_bounded_directory_holds_its_cap_and_a_reader_restores_bit_exact(tmp_path):
    directory = tmp_path / "l3"
    writer, peak = run_sampled(CP4, directory, tmp_path / "writer.json")
    assert writer["ok"] and writer["corrupted_pages"] == 0
    # it wrote well past the cap, and the directory held it (+ one object per writer thread)
    assert writer["l3_written_pages"] * PAGE_OBJECTS > 1.5 * CAP
    assert peak <= CAP + 4 * THREADS * KV_OBJECT, (peak, CAP)
    assert stored_bytes(directory) <= CAP
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    reader, _ = run_sampled(CP2, copy, tmp_path / "reader.json")
    assert reader["ok"] and reader["corrupted_pages"] == 0 and reader["l3_rejected_objects"] == 0
    assert reader["l3_hit_tokens"] > 0 and reader["l3_pages_verified"] > 0
