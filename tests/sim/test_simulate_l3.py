"""``simulate --l3 DIR``: a CP 4 run writes L3, a CP 2 run of the same
workload on the same DIR restores from it bit-exact; a corrupted object is
refused, never restored; bad --l3 values stop the run before a rank starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sglang.srt.mem_cache.utils import get_hash_str

from sglang_cp_hicache.sim.workload import synthetic_chat
from tests.sim.simrun import simulate

REQUESTS = 60
P = 64
# The same logical capacity at both CP sizes ((16 * 4 - 1) * 64 usable
# tokens), so both runs replay the same synthetic workload; a host pool of
# 8 pages a rank evicts host copies, so later requests must come from L3.
CP4 = ("--cp-size", "4", "--device-pages", "16", "--host-pages", "8")
CP2 = ("--cp-size", "2", "--device-pages", "32", "--host-pages", "16")


def run(tmp: Path, name: str, shape: tuple[str, ...], l3: Path) -> tuple[int, dict, str]:
    out = tmp / f"{name}.json"
    proc, _ = simulate(*shape, "--requests", str(REQUESTS), "--l3", str(l3), "--json", str(out), timeout=300)
    summary = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, summary, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """One L3 directory written by a CP 4 run."""
    tmp = tmp_path_factory.mktemp("l3sim")
    directory = tmp / "l3"  # created by --l3
    code, summary, text = run(tmp, "cp4", CP4, directory)
    assert code == 0, text
    assert summary["corrupted_pages"] == 0 and summary["ranks_agree"]
    per_rank = summary["l3_written_pages_per_rank"]
    assert len(per_rank) == 4 and all(n > 0 for n in per_rank)
    assert summary["l3_written_pages"] == sum(per_rank)
    # KV + indexer object per page; each rank wrote only its own pages, no page twice.
    assert len(list(directory.rglob("*.bin"))) == 2 * summary["l3_written_pages"]
    return directory


@pytest.mark.slow(40)
def test_cp4_writes_cp2_restores_bit_exact(written, tmp_path):
    code, summary, text = run(tmp_path, "cp2", CP2, written)
    assert code == 0, text
    assert summary["ok"] and summary["ranks_agree"] and summary["corrupted_pages"] == 0
    assert summary["l3_hit_tokens"] > 0
    assert summary["l3_pages_verified"] > 0
    # Every restored page lands on exactly one owner and is checked at its first load.
    assert summary["l3_pages_verified"] <= summary["l3_hit_tokens"] // P
    assert summary["l3_pages_verified"] <= summary["restored_pages_verified"]
    assert summary["l3_rejected_objects"] == 0
    assert summary["l3_hit_tokens"] == sum(summary["l3_hit_tokens_per_rank"])
    assert "L3 pages verified" in text


def _first_page_objects(directory: Path) -> list[Path]:
    """The KV and indexer objects of request 0's first page: the first
    request of the CP 2 run finds nothing cached and looks its whole chain up."""
    tokens = synthetic_chat(REQUESTS, seed=0, max_tokens=(16 * 4 - 1) * P // 2)[0].tokens
    page_hash = get_hash_str(list(tokens[:P]), None, page_size=P)[0]
    return sorted(directory.rglob(f"{page_hash}_*.bin"))


def test_corrupted_object_is_rejected_not_restored(written, tmp_path):
    directory = tmp_path / "l3"
    shutil.copytree(written, directory)
    objects = _first_page_objects(directory)
    assert len(objects) == 2, objects  # KV and indexer
    data = bytearray(objects[0].read_bytes())
    data[-1] ^= 0x01  # one payload bit
    objects[0].write_bytes(bytes(data))
    code, summary, text = run(tmp_path, "cp2_bad", CP2, directory)
    assert code == 0, text
    assert summary["corrupted_pages"] == 0 and summary["ranks_agree"]
    assert summary["l3_rejected_objects"] >= 1


def test_unusable_l3_directory_is_refused_before_any_rank(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc, seconds = simulate("--cp-size", "2", "--requests", "2", "--l3", str(not_a_dir), timeout=60)
    assert proc.returncode == 2
    assert "--l3" in proc.stderr and "not a usable L3 directory" in proc.stderr
    assert not_a_dir.read_text() == "x"


def test_l3_refused_with_sglang_0523_upstream_copies(tmp_path):
    directory = tmp_path / "l3"
    proc, _ = simulate("--sglang", "0.5.23", "--copy", "upstream", "--l3", str(directory), timeout=60)
    assert proc.returncode == 2
    assert "--l3 needs --copy library on --sglang 0.5.23" in proc.stderr
    assert not directory.exists()
