"""The README's launch lines, parsed by the installed SGLang's own argument
parser (tests for each release use it with their release)."""

from __future__ import annotations

import argparse
import pathlib
import shlex

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
LAUNCH = "python -m sglang.launch_server"


def launch_line(marker: str) -> list[str]:
    """The arguments of the README code block whose first line is the comment
    starting with ``marker`` (continuation lines joined)."""
    text = README.read_text()
    start = text.index(f"# {marker}")
    block = text[start:text.index("```", start)]
    command = " ".join(line.rstrip("\\").strip() for line in block.splitlines()[1:] if line.strip())
    assert command.startswith(LAUNCH), command
    return shlex.split(command[len(LAUNCH):])


def with_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (None: left out; "": a switch)."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        del argv[i:i + 1 + takes_value]
    return argv + ([flag] if value == "" else [flag, value] if value is not None else [])


def parse_with_sglang(args: list[str]) -> argparse.Namespace:
    """``args`` through SGLang's ``ServerArgs.add_cli_args`` parser: an unknown
    flag, an abbreviated one or a value outside its choices exits (SystemExit)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(allow_abbrev=False)  # the README spells every flag out
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


def check_kernel_pool_config(release: str, argv: list[str]) -> None:
    """The kernel pool configuration ``check`` derives from ``argv`` is one
    the kernels accept (argument checks; the compile itself needs a GPU)."""
    from sglang_cp_hicache.kernels import transfer
    from sglang_cp_hicache.preflight import launch

    args, _ = launch.launch_findings(release, argv)
    config = launch.kernel_config(release, args)
    assert config["page_size"] == 64 and config["host_layout"] == args.hicache_mem_layout
    report = transfer.warmup(**config, device="cpu")
    assert report.config["kv_dim"] == config["kv_dim"]


def check_one_failure_naming(release: str, argv: list[str], flag: str, words: str) -> None:
    """``check``'s argument checks of ``argv`` fail once, on ``flag``, saying ``words``."""
    from sglang_cp_hicache.preflight import launch
    from sglang_cp_hicache.preflight.report import FAIL

    _, found = launch.launch_findings(release, argv)
    failed = [f for f in found if f.level == FAIL]
    assert len(failed) == 1, found
    assert flag in failed[0].what and words in failed[0].text, failed[0]
