"""The simulator's writer manifests live in the shared L3 directory: they
are written without following a link and read without waiting on a FIFO."""

from __future__ import annotations

import os
import threading

import pytest

from sglang_cp_hicache.sim.l3_writers import MANIFEST_DIR, write_manifest, writers_of


def test_a_manifest_round_trips(tmp_path):
    path = write_manifest(str(tmp_path), "0.5.18", ["b", "a"])
    assert path.parent == tmp_path / MANIFEST_DIR and path.suffix == ".json"
    assert writers_of(str(tmp_path)) == {"a": "0.5.18", "b": "0.5.18"}
    assert [p.name for p in (tmp_path / MANIFEST_DIR).iterdir()] == [path.name]  # no temporary file left


def test_a_manifest_folder_that_is_a_link_is_never_written_through(tmp_path):
    directory, elsewhere = tmp_path / "l3", tmp_path / "elsewhere"
    directory.mkdir()
    elsewhere.mkdir()
    (directory / MANIFEST_DIR).symlink_to(elsewhere)
    with pytest.raises(NotADirectoryError):
        write_manifest(str(directory), "0.5.18", ["a"])
    assert os.listdir(elsewhere) == []


def test_fifos_and_links_among_the_manifests_are_skipped_promptly(tmp_path):
    write_manifest(str(tmp_path), "0.5.23", ["a"])
    folder = tmp_path / MANIFEST_DIR
    outside = tmp_path / "outside.json"
    outside.write_text('{"release": "forged", "objects": ["b"]}')
    (folder / "0-link.json").symlink_to(outside)
    fifo = folder / "1-fifo.json"
    os.mkfifo(fifo)
    found: list = []
    reader = threading.Thread(target=lambda: found.append(writers_of(str(tmp_path))), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # a regression: let the blocked reader go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive(), "blocked on a FIFO"
    assert found == [{"a": "0.5.23"}]
