"""``python -m sglang_cp_hicache check -- <the server's launch arguments>``:
a preflight for the GPU server, before SGLang is launched. It starts
nothing (no server, no rank, no GPU memory beyond compiling the copy
kernels once) and prints one line per check -- ``OK``, ``WARN`` or ``FAIL``,
what was checked, why, and what to do -- then exits 0, or 2 when a check
failed:

* the installed SGLang release and whether SGLang will load the plugin that
  serves it (its entry point, ``SGLANG_PLUGINS``);
* every setting, read as the cache reads it at start-up;
* the launch arguments, parsed by that release's own ``ServerArgs`` parser
  (SGLang's resolution in ``ServerArgs.__post_init__`` is not run: it
  loads the model's config and sizes GPU memory) and checked by the
  release's adapter (``sglang_0518.preflight`` / ``sglang_0523.preflight``);
* the L3 those arguments name: a file directory (exists or can be created,
  owner, mode, free space against ``max_size``) or a Mooncake master (one
  TCP connection, 2 s);
* Triton, the CUDA GPU, and the copy kernels compiled once for the pools.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from sglang_cp_hicache.preflight.report import Finding, exit_status, render

__all__ = ["add_check_parser", "run_check", "run_checks"]


def run_checks(launch_args: Sequence[str]) -> list[Finding]:
    """Every check on the server to be launched with ``launch_args``."""
    from sglang_cp_hicache.preflight import device, launch, storage

    triton_cache_before = device.triton_cache_dir()  # SGLang's import may set it
    version = launch.installed_sglang()
    found = launch.release_findings(version) + launch.plugin_findings(version) + launch.settings_findings()
    args: Optional[argparse.Namespace] = None
    if version is not None:
        args, parsed = launch.launch_findings(version, launch_args)
        found += parsed
    if args is not None:
        found += storage.l3_findings(args, version, refused_above=launch.has_adapter_checks(version))
    has_triton, lines = device.triton_findings()
    found += lines
    has_gpu, lines = device.device_findings()
    found += lines
    return found + device.kernel_findings(has_gpu, has_triton, launch.kernel_config(version, args),
                                          device.cache_origin(triton_cache_before))


def _strip_separator(argv: Sequence[str]) -> list[str]:
    # argparse keeps the "--" that separates ours from the server's arguments
    argv = list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def run_check(launch_args: Sequence[str]) -> int:
    """Print every check's line; 0 when none failed, else 2."""
    found = run_checks(_strip_separator(launch_args))
    print(render(found))
    status = exit_status(found)
    failed = sum(f.level == "FAIL" for f in found)
    print(f"check: {failed} of {len(found)} failed" if failed else f"check: none of {len(found)} failed")
    return status


def add_check_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check",
        usage="%(prog)s -- <the server's launch arguments, as given to python -m sglang.launch_server>",
        help="preflight on the GPU server before launching SGLang: python -m sglang_cp_hicache check -- <launch args>",
        description=(
            "Check, starting nothing, what a server launched with the given arguments needs from this library: "
            "the SGLang release and its plugin, the settings, the launch arguments (parsed by that release's own "
            "parser), the L3, Triton, the GPU and the copy kernels (compiled once)."
        ),
        epilog="exit status: 0 = no check failed (warnings allowed); 2 = a check failed (its FAIL line says why).",
    )
    p.add_argument("launch_args", nargs=argparse.REMAINDER, metavar="-- LAUNCH_ARGS",
                   help="the arguments of python -m sglang.launch_server, after --")
    p.set_defaults(func=lambda args: run_check(args.launch_args))
    return p
