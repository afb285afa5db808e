"""A file L3 directory that others can write: the tier never writes or reads
through a link planted under any name it uses, never blocks on a FIFO,
refuses a world-writable directory without the sticky bit, warns about the
system temp dir, and creates what it makes shareable by a group."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading
import traceback
from pathlib import Path

import pytest

from sglang_cp_hicache.l3.capacity import CapacityConfig
from sglang_cp_hicache.l3.envelope import HEADER_BYTES, pack
from sglang_cp_hicache.l3.keys import page_keys
from sglang_cp_hicache.l3.store import FilePageStore
from tests.l3.common import hash_chain, namespace, payload

NS = namespace()
OBJECT = HEADER_BYTES + NS.page_bytes
BOUNDED = CapacityConfig(max_size=100 * OBJECT)


def _key_and_blob(seed: int = 1) -> tuple[str, bytes]:
    key = page_keys(hash_chain(1, seed=seed), NS)[0]
    return key, pack(key, NS, payload(NS, seed))


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    return victim


def _untouched(victim: Path) -> bool:
    return victim.read_bytes() == b"precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600


def _promptly(call, timeout_s: float = 10.0):
    """``call()``'s result, or a failure (not a hang) if it blocks."""
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "blocked (on a FIFO?)"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _release_fifo(path: Path) -> None:
    """Unblock a reader stuck on the FIFO ``path`` (a regression) so the test process ends."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


# ---- 1. no write or read through a link ------------------------------------------------------------


def test_links_at_the_state_and_its_old_temp_names_are_never_written_through(tmp_path):
    """Earlier releases wrote the state to ``.l3-capacity.{pid}.{thread}``
    with a truncating open that followed a link planted there."""
    directory, victim = tmp_path / "l3", _victim(tmp_path)
    directory.mkdir()
    for name in (f".l3-capacity.{os.getpid()}.{threading.get_ident()}", ".l3-capacity"):
        (directory / name).symlink_to(victim)
    store = FilePageStore(directory, capacity=BOUNDED)
    key, blob = _key_and_blob()
    assert store.put([key], [blob]) == [True]
    assert _untouched(victim)
    state = directory / ".l3-capacity"
    assert not state.is_symlink() and state.is_file()  # the link was replaced, not followed
    assert store.capacity.used_bytes() == OBJECT


@pytest.mark.parametrize("dangling", [True, False])
def test_a_link_at_the_lock_name_is_refused_naming_it(tmp_path, dangling):
    directory, victim = tmp_path / "l3", _victim(tmp_path)
    directory.mkdir()
    target = tmp_path / "made-by-the-server" if dangling else victim
    (directory / ".l3-capacity.lock").symlink_to(target)
    with pytest.raises(ValueError, match=r"\.l3-capacity\.lock is a symbolic link"):
        FilePageStore(directory, capacity=BOUNDED)
    assert not (tmp_path / "made-by-the-server").exists()
    assert _untouched(victim)


def test_a_lock_swapped_for_a_link_while_running_fails_the_write_not_the_server(tmp_path, caplog):
    directory, victim = tmp_path / "l3", _victim(tmp_path)
    store = FilePageStore(directory, capacity=BOUNDED)
    lock = directory / ".l3-capacity.lock"
    lock.unlink()
    lock.symlink_to(victim)
    key, blob = _key_and_blob()
    assert store.put([key], [blob]) == [False]
    assert "is a symbolic link" in caplog.text and _untouched(victim)
    lock.unlink()  # the operator removes it: writes go on
    assert store.put([key], [blob]) == [True]


def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path):
    directory = tmp_path / "l3"
    directory.mkdir()
    os.mkfifo(directory / ".l3-capacity.lock")
    with pytest.raises(ValueError, match=r"\.l3-capacity\.lock is a FIFO"):
        _promptly(lambda: FilePageStore(directory, capacity=BOUNDED))


def test_a_fifo_as_the_state_is_rebuilt_not_waited_on(tmp_path):
    directory = tmp_path / "l3"
    store = FilePageStore(directory, capacity=BOUNDED)
    key, blob = _key_and_blob()
    assert store.put([key], [blob]) == [True]
    state = directory / ".l3-capacity"
    state.unlink()
    os.mkfifo(state)
    try:
        assert _promptly(store.capacity.used_bytes) == OBJECT  # counted again from the directory
    finally:
        _release_fifo(state)


def test_a_fifo_under_a_key_is_a_prompt_miss(tmp_path, caplog):
    """Swapped in after an existence check, a FIFO would block an I/O
    thread's open for good."""
    store = FilePageStore(tmp_path)
    key, blob = _key_and_blob()
    path = store.path_of(key)
    path.parent.mkdir()
    os.mkfifo(path)
    try:
        assert _promptly(lambda: store.get([key])) == [None]
        assert _promptly(lambda: store.get([key], [len(blob)])) == [None]
        assert _promptly(lambda: store.open_object(key, len(blob))) is None
        view = memoryview(bytearray(len(blob)))
        assert _promptly(lambda: store.read_into(key, len(blob), [view])) is None
        assert store.exists([key]) == [False]
    finally:
        _release_fifo(path)
    assert "is a FIFO" in caplog.text
    assert store.put([key], [blob]) == [True] and store.get([key]) == [blob]  # a write replaces it


def test_a_link_under_a_key_to_a_sound_object_is_not_read(tmp_path):
    store = FilePageStore(tmp_path / "l3")
    key, blob = _key_and_blob()
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(blob)  # the very object the key should hold
    path = store.path_of(key)
    path.parent.mkdir()
    path.symlink_to(elsewhere)
    assert store.exists([key]) == [False]
    assert store.get([key]) == [None] and store.get([key], [len(blob)]) == [None]
    assert store.open_object(key, len(blob)) is None
    assert store.read_into(key, len(blob), [memoryview(bytearray(len(blob)))]) is None
    assert store.put([key], [blob]) == [True]
    assert not path.is_symlink() and elsewhere.read_bytes() == blob  # replaced, not written through


@pytest.mark.parametrize("bounded", [False, True])
def test_a_key_subdirectory_that_is_a_link_is_never_written_through(tmp_path, bounded, caplog):
    directory, elsewhere = tmp_path / "l3", tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = FilePageStore(directory, capacity=BOUNDED if bounded else None)
    key, blob = _key_and_blob()
    (directory / key[:2]).symlink_to(elsewhere)
    assert store.put([key], [blob]) == [False]
    assert "cannot write" in caplog.text
    assert os.listdir(elsewhere) == []
    if bounded:
        assert store.capacity.used_bytes() == 0  # the failed write gave its reservation back


def test_eviction_and_the_sweep_never_reach_through_a_linked_subdirectory(tmp_path):
    directory, elsewhere = tmp_path / "l3", tmp_path / "elsewhere"
    elsewhere.mkdir()
    key, blob = _key_and_blob()
    decoy = elsewhere / f"{key}.bin"
    decoy.write_bytes(blob)
    stale_tmp = elsewhere / f".{key}.bin.1.dead.tmp"
    stale_tmp.write_bytes(b"x")
    os.utime(stale_tmp, (0, 0))
    directory.mkdir()
    (directory / key[:2]).symlink_to(elsewhere)
    store = FilePageStore(directory, capacity=CapacityConfig(max_size=2 * OBJECT, eviction_ratio=0.5))
    for seed in range(2, 6):
        other, other_blob = _key_and_blob(seed)
        if other[:2] != key[:2]:
            store.put([other], [other_blob])
    assert store.sweep(max_age_s=0) == 0
    assert decoy.read_bytes() == blob and stale_tmp.exists()
    assert store.capacity.evicted_objects >= 1  # it did evict, inside the directory


# ---- 2. the directory's own permissions ------------------------------------------------------------


def test_a_world_writable_directory_without_the_sticky_bit_is_refused(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(ValueError, match=r"'.*open' is world-writable without the sticky bit.*replace other"):
        FilePageStore(directory)
    assert os.listdir(directory) == []


def test_a_world_writable_directory_with_the_sticky_bit_is_used_and_its_subdirectories_keep_it(tmp_path):
    directory = tmp_path / "sticky"
    directory.mkdir()
    directory.chmod(0o1777)
    store = FilePageStore(directory, capacity=BOUNDED)
    key, blob = _key_and_blob()
    assert store.put([key], [blob]) == [True] and store.get([key]) == [blob]
    assert store.path_of(key).parent.stat().st_mode & stat.S_ISVTX


def test_a_umask_of_zero_never_makes_world_writable_subdirectories(tmp_path):
    directory = tmp_path / "group"
    directory.mkdir()
    directory.chmod(0o2770)
    old = os.umask(0)
    try:
        store = FilePageStore(directory)
        key, blob = _key_and_blob()
        assert store.put([key], [blob]) == [True]
    finally:
        os.umask(old)
    assert not store.path_of(key).parent.stat().st_mode & stat.S_IWOTH


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "system temp dir" in
            r.getMessage()]


def test_a_directory_in_the_system_temp_dir_is_warned_about_once_at_open(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sglang_cp_hicache.l3.store"):
        FilePageStore(tmp_path / "hicache")  # as SGLang's /tmp/hicache
        [line] = _warnings(caplog)
        assert "other local users can pre-create it or fill it" in line
        assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" in line and "file_storage_path" in line
        caplog.clear()
        private = tmp_path / "mine"
        private.mkdir(mode=0o700)
        FilePageStore(private / "l3")  # below a directory only this account reaches
        outside = Path(tempfile.mkdtemp(dir=os.getcwd()))
        try:
            monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "elsewhere"))
            FilePageStore(outside)
        finally:
            shutil.rmtree(outside)
        assert _warnings(caplog) == []
        shared = tmp_path / "shared"  # like /var/tmp or /dev/shm: world-writable, sticky
        shared.mkdir()
        shared.chmod(0o1777)
        FilePageStore(shared / "l3")
        assert len(_warnings(caplog)) == 1


# ---- 3. shared between accounts --------------------------------------------------------------------


def _created_modes(directory: Path, umask: int) -> dict[str, int]:
    old = os.umask(umask)
    try:
        store = FilePageStore(directory, capacity=BOUNDED)
        key, blob = _key_and_blob()
        assert store.put([key], [blob]) == [True]
    finally:
        os.umask(old)
    paths = {"lock": directory / ".l3-capacity.lock", "state": directory / ".l3-capacity",
             "object": store.path_of(key), "subdir": store.path_of(key).parent}
    return {name: stat.S_IMODE(p.stat().st_mode) for name, p in paths.items()}


def test_files_and_subdirectories_follow_the_umask(tmp_path):
    group = _created_modes(tmp_path / "group", 0o002)
    assert all(mode & stat.S_IWGRP and not mode & stat.S_IWOTH for mode in group.values()), group
    private = _created_modes(tmp_path / "private", 0o022)
    assert not any(mode & (stat.S_IWGRP | stat.S_IWOTH) for mode in private.values()), private


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to run a second account (setuid in a forked child)")
def test_a_second_account_of_the_group_shares_a_setgid_directory(tmp_path):
    gid, uid = 4242, 65534  # numeric ids: nothing is added to the system
    shared = Path(tempfile.mkdtemp(prefix="l3-shared-", dir="/tmp"))  # reachable by the second account
    try:
        os.chown(shared, 0, gid)
        shared.chmod(0o2775)
        config = CapacityConfig(max_size=4 * OBJECT, eviction_ratio=0.5)
        pages = [_key_and_blob(seed) for seed in range(1, 7)]
        old = os.umask(0o002)
        try:
            first = FilePageStore(shared, capacity=config)
            assert first.put([pages[0][0]], [pages[0][1]]) == [True]
        finally:
            os.umask(old)
        pid = os.fork()
        if pid == 0:  # the second account: writes (evicting the first's objects) and reads
            code = 3
            try:
                os.setgroups([gid])
                os.setgid(gid)
                os.setuid(uid)
                os.umask(0o002)
                second = FilePageStore(shared, capacity=config)
                wrote = [second.put([k], [b]) == [True] for k, b in pages[1:]]
                code = 0 if all(wrote) and second.get([pages[-1][0]]) == [pages[-1][1]] else 1
            except BaseException:  # noqa: BLE001 - shown in the test's output, then the exit code fails it
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert first.capacity.used_bytes() <= 4 * OBJECT
        assert first.get([pages[-1][0]]) == [pages[-1][1]]
        owners = {p.stat().st_uid for p in shared.rglob("*.bin")}
        assert uid in owners
    finally:
        shutil.rmtree(shared)

