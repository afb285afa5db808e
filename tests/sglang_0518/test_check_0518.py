"""``check`` on SGLang 0.5.18: the README's launch line passes every
argument check; a flag value the CP cache refuses fails naming the flag.
In-process: the arguments go through 0.5.18's own parser (milliseconds)."""

from __future__ import annotations

import pytest

from sglang_cp_hicache.preflight import launch
from sglang_cp_hicache.preflight.report import FAIL, OK

from tests.helpers.readme_launch import check_kernel_pool_config, check_one_failure_naming, launch_line, with_flag

RELEASE = "0.5.18"
README_LINE = launch_line("SGLang 0.5.18 server")


def _checked(argv: list[str]):
    args, found = launch.launch_findings("0.5.18", argv)
    return args, found


def _with(flag: str, value: str | None) -> list[str]:
    """The README line with ``flag`` set to ``value``."""
    return with_flag(README_LINE, flag, value)


def test_the_readme_launch_line_passes_every_argument_check():
    args, found = _checked(README_LINE)
    assert args is not None and args.radix_cache_backend == "cp-hicache"
    assert [f for f in found if f.level != OK] == []
    assert {"--radix-cache-backend", "--enable-hierarchical-cache", "--page-size", "--hicache-mem-layout"} <= {
        f.what for f in found}


@pytest.mark.parametrize("flag, value, words", [
    ("--hicache-storage-backend", "nixl", "hicache_storage_backend='nixl' refused"),
    ("--hicache-write-policy", "write_back", "write_back"),
    ("--radix-cache-backend", None, "--radix-cache-backend cp-hicache"),
    ("--enable-hierarchical-cache", None, "off: "),
    ("--page-size", "32", "32"),
    ("--cp-strategy", "zigzag", "--cp-strategy 'zigzag'"),
    ("--attn-cp-size", "3", "not divisible by --attn-cp-size 3"),
    ("--hicache-mem-layout", "page_head", "'page_head'"),
])
def test_a_value_the_cp_cache_refuses_fails_naming_the_flag(flag, value, words):
    check_one_failure_naming(RELEASE, _with(flag, value), flag, words)


def test_a_value_sglang_s_parser_refuses_fails_with_its_message():
    args, found = _checked(_with("--hicache-storage-backend", "bogus"))
    assert args is None
    assert found[-1].level == FAIL and found[-1].what == "launch arguments"
    assert "--hicache-storage-backend" in found[-1].text and "invalid choice: 'bogus'" in found[-1].text


def test_the_kernel_pool_configuration_is_one_the_kernels_accept():
    check_kernel_pool_config(RELEASE, README_LINE)
