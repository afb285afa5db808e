"""``python -m sglang_cp_hicache check``: the L3 directory and Mooncake
checks, the settings and plugin lines, the GPU lines on a machine without
one, and the command end to end (one subprocess, on the installed SGLang)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_cp_hicache import settings
from sglang_cp_hicache.__main__ import build_parser
from sglang_cp_hicache.preflight import _strip_separator, device, launch, storage
from sglang_cp_hicache.preflight.report import EXIT_FAIL, EXIT_OK, FAIL, OK, WARN, Finding, exit_status
from sglang_cp_hicache.testing.env import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
_DIR_SETTINGS = (settings.L3_DIR.name, settings.SGLANG_FILE_DIR.name, settings.FILE_MAX_SIZE.name,
                 settings.FILE_MIN_FREE.name, settings.L3_KEY_FILE.name)


@pytest.fixture(autouse=True)
def _no_l3_settings(monkeypatch):
    for name in _DIR_SETTINGS:  # the directory must come from the arguments under test
        monkeypatch.delenv(name, raising=False)


def _file_l3(path: Path, **extra) -> SimpleNamespace:
    config = json.dumps({"file_storage_path": str(path), **extra})
    return SimpleNamespace(hicache_storage_backend="file", hicache_storage_backend_extra_config=config,
                           tp_size=2, pp_size=1, model_path=tiny_model_dir())


def _dir_line(found: list[Finding]) -> Finding:
    return next(f for f in found if f.what == "L3 directory")


def test_a_directory_under_a_regular_file_fails_naming_both(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    found = storage.l3_findings(_file_l3(blocker / "l3"), "0.5.18")
    line = _dir_line(found)
    assert line.level == FAIL and str(blocker / "l3") in line.text and f"{blocker} is not a directory" in line.text
    assert exit_status(found) == EXIT_FAIL


def test_a_regular_file_as_the_directory_fails(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    line = _dir_line(storage.l3_findings(_file_l3(path), "0.5.18"))
    assert line.level == FAIL and "exists and is not a directory" in line.text


def test_world_writable_fails_without_the_sticky_bit_and_warns_with_it(tmp_path):
    path = tmp_path / "l3"
    path.mkdir()
    path.chmod(0o777)
    line = _dir_line(storage.l3_findings(_file_l3(path), "0.5.18"))
    assert line.level == FAIL and str(path) in line.text and "without the sticky bit (mode 0777)" in line.text
    path.chmod(0o1777)
    line = _dir_line(storage.l3_findings(_file_l3(path), "0.5.18"))
    assert line.level == WARN and "mode 1777" in line.text and settings.L3_KEY_FILE.name in line.text


def test_a_directory_of_another_account_and_group_fails(tmp_path, monkeypatch):
    path = tmp_path / "l3"
    path.mkdir()
    st = path.stat()
    monkeypatch.setattr(os, "geteuid", lambda: st.st_uid + 4242)
    monkeypatch.setattr(os, "getegid", lambda: st.st_gid + 4242)
    monkeypatch.setattr(os, "getgroups", lambda: [st.st_gid + 4243])
    line = _dir_line(storage.l3_findings(_file_l3(path), "0.5.18"))
    assert line.level == FAIL and f"uid {st.st_uid}" in line.text and "chown" in line.text
    # Accounts and groups by name and number (the stand-in euid may have no name: its number then).
    owner, group = pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name
    assert f"owned by {owner} (uid {st.st_uid}) and group {group} (gid {st.st_gid})" in line.text
    assert f"uid {st.st_uid + 4242})) nor" in line.text or f"(uid {st.st_uid + 4242}) nor" in line.text


def test_a_usable_directory_reports_its_space_against_max_size(tmp_path):
    path = tmp_path / "l3"
    path.mkdir(mode=0o750)
    found = storage.l3_findings(_file_l3(path, max_size="1M"), "0.5.18")
    assert [f.level for f in found] == [OK, OK, OK, OK], found  # directory, space, key, model
    assert found[3].text.startswith("dir:")
    assert "max_size 0.0 GiB" in found[1].text
    huge = storage.l3_findings(_file_l3(path, max_size="1000000T"), "0.5.18")
    assert huge[1].level == WARN and "is more than the" in huge[1].text
    unbounded = storage.l3_findings(_file_l3(path), "0.5.18")
    assert unbounded[1].level == WARN and "no max_size or min_free_space" in unbounded[1].text
    bad = storage.l3_findings(_file_l3(path, max_size="lots"), "0.5.18")
    assert bad[1].level == FAIL and "max_size" in bad[1].text


def test_a_model_nothing_local_names_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty Hub cache
    monkeypatch.delenv(settings.L3_MODEL_ID.name, raising=False)
    args = _file_l3(tmp_path / "l3", max_size="1M")
    args.model_path = "nobody/no-such-model"
    line = storage.l3_findings(args, "0.5.18")[-1]
    assert line.level == WARN and line.what == "L3 model identity" and "nobody/no-such-model" in line.text


def test_a_missing_directory_that_can_be_created_passes_without_creating_it(tmp_path):
    path = tmp_path / "a" / "b"
    line = _dir_line(storage.l3_findings(_file_l3(path), "0.5.18"))
    assert line.level == OK and "does not exist yet" in line.text and str(tmp_path) in line.text
    assert not (tmp_path / "a").exists()


def test_the_mooncake_master_is_one_tcp_connect():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        args = SimpleNamespace(hicache_storage_backend="mooncake", tp_size=2, pp_size=1,
                               hicache_storage_backend_extra_config=json.dumps({"master_server_address": address}))
        found = storage.l3_findings(args, "0.5.18")  # the store's own reading of its settings, then the connect
        assert [(f.level, f.what) for f in found][:2] == [(OK, "Mooncake master"), (OK, "L3 key")], found
    start = time.monotonic()
    closed = storage.master_findings(address)[0]  # nothing listens there any more
    assert closed.level == FAIL and address in closed.text and time.monotonic() - start < 3


def test_mooncake_settings_come_from_the_extra_config():
    args = SimpleNamespace(hicache_storage_backend="mooncake", tp_size=2, pp_size=1,
                           hicache_storage_backend_extra_config=json.dumps({"master_server_address": "nohost"}))
    found = storage.l3_findings(args, "0.5.23")
    assert found[0].level == FAIL and "host:port" in found[0].text


def test_an_unsupported_backend_fails_unless_an_adapter_said_so():
    args = SimpleNamespace(hicache_storage_backend="nixl", hicache_storage_backend_extra_config=None)
    assert storage.l3_findings(args, None)[0].level == FAIL
    assert storage.l3_findings(args, "0.5.18", refused_above=True)[0].level == WARN


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_no_gpu_is_reported_as_what_it_is():
    has_gpu, found = device.device_findings()
    assert not has_gpu and found[0].level == FAIL
    assert found[0].line().startswith("FAIL device: no CUDA GPU visible (torch.cuda.is_available() is False): "
                                      "the copy kernels cannot run here")
    skipped = device.kernel_findings(False, True, {"host_layout": "layer_first"})[0]
    assert skipped.level == WARN and skipped.text.startswith("skipped: no CUDA GPU visible")
    assert device.triton_cache_dir() in skipped.text


def test_an_invalid_setting_and_a_left_out_plugin_fail_naming_them(monkeypatch):
    monkeypatch.setenv(settings.COPY.name, "bogus")
    assert launch.settings_findings()[0].level == FAIL and settings.COPY.name in launch.settings_findings()[0].text
    monkeypatch.delenv(settings.COPY.name)
    assert launch.settings_findings()[0].level == OK
    monkeypatch.setenv("SGLANG_PLUGINS", "other_plugin")
    line = launch.plugin_findings("0.5.23")[0]
    assert line.level == FAIL and "leaves out 'cp_hicache_0523'" in line.text
    assert launch.release_findings("0.4.0")[0].level == FAIL
    assert launch.release_findings(None)[0].level == FAIL


def test_the_check_command_takes_every_argument_after_the_separator():
    args = build_parser().parse_args(["check", "--", "--model-path", "m", "--tp-size", "8"])
    assert _strip_separator(args.launch_args) == ["--model-path", "m", "--tp-size", "8"]
    assert exit_status([Finding(WARN, "x", "y")]) == EXIT_OK


def _launch_line() -> list[str]:
    from tests.helpers.readme_launch import launch_line

    release = launch.installed_sglang()
    marker = {"0.5.18": "SGLang 0.5.18 server", "0.5.23": "SGLang 0.5.23 prefill worker"}.get(release)
    if marker is None:
        pytest.skip(f"no README launch line for SGLang {release}")
    return launch_line(marker)


def test_the_command_exits_2_naming_an_unusable_l3_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    argv = _launch_line() + ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                             json.dumps({"file_storage_path": str(blocker / "l3")})]
    env = {k: v for k, v in os.environ.items() if k not in _DIR_SETTINGS and k != "SGLANG_PLUGINS"}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_cp_hicache", "check", "--", *argv], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    assert proc.returncode == 2, text
    assert f"FAIL L3 directory: {blocker / 'l3'}" in text and f"{blocker} is not a directory" in text, text
    assert "OK   launch arguments: parsed by SGLang" in text, text
    # CPU seconds, not wall (a loaded test machine's clock says little of the command): measured on two
    # busy cores, 8.3 to 8.5, of which importing torch and SGLang's server_args alone take 7.8; 15 leaves
    # room for a loaded machine's slower CPU seconds, never for a wait or a second SGLang import
    assert usage.ru_utime + usage.ru_stime < 15, (usage, text)


def test_the_kernel_line_on_a_gpu_names_what_compiled_and_the_cache_dir(monkeypatch):
    from sglang_cp_hicache.kernels import transfer

    calls = []

    def on_the_cpu(**config):  # the compile itself needs the GPU: the reference backend stands in
        calls.append(config)
        return real(**{**config, "device": "cpu"})

    real = transfer.warmup
    monkeypatch.setattr(transfer, "warmup", on_the_cpu)
    config = dict(page_size=64, host_layout="layer_first", num_layers=1, kv_dim=576,
                  kv_dtype=__import__("torch").uint8, indexer_page_bytes=132 * 64)
    line = device.kernel_findings(True, True, config, "why")[0]
    assert calls[0]["device"] == "cuda:0" and line.level == OK
    assert "on reference" in line.text and f"{device.triton_cache_dir()} (why)" in line.text

    def broken(**config):
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(transfer, "warmup", broken)
    line = device.kernel_findings(True, True, config)[0]
    assert line.level == FAIL and "ptxas died" in line.text
    assert device.kernel_findings(True, True, None)[0].level == WARN
