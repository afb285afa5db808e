"""The SGLang side of the check: the installed release, which plugin SGLang
will load, the settings, and the launch arguments parsed by that release's
own ``ServerArgs`` argument parser and checked by its adapter.

Only the parser runs (``ServerArgs.add_cli_args``, then ``parse_args`` as
SGLang's ``prepare_server_args`` does, ``--config`` merged the same way):
``ServerArgs.from_cli_args`` would run ``__post_init__``, which loads the
model's config (a Hub name means a download) and sizes GPU memory -- SGLang
runs that at launch; this check starts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

from sglang_cp_hicache import releases, settings
from sglang_cp_hicache.preflight.report import FAIL, OK, WARN, Finding

__all__ = ["has_adapter_checks", "installed_sglang", "kernel_config", "launch_findings", "parse_launch_args", "plugin_findings", "release_findings",
           "settings_findings"]

_PLUGIN_GROUP = "sglang.srt.plugins"
#: Each adapter's checks of the parsed arguments, imported only for its release.
_ADAPTER_CHECKS = {"0.5.18": "sglang_cp_hicache.sglang_0518.preflight",
                   "0.5.23": "sglang_cp_hicache.sglang_0523.preflight"}


def installed_sglang() -> Optional[str]:
    """The installed SGLang release (package metadata, nothing imported), or None."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def release_findings(version: Optional[str]) -> list[Finding]:
    served = ", ".join(r.sglang_version for r in releases.RELEASES)
    if version is None:
        return [Finding(FAIL, "SGLang", f"not installed for {sys.executable}; run this check with the Python "
                                        f"that runs the server (SGLang {served})")]
    adapter = releases.adapter_for(version)
    if adapter is not None:
        return [Finding(OK, "SGLang", f"{version} ({sys.executable}); this package's plugin {adapter.plugin} "
                                      "serves it")]
    if settings.enabled(settings.ALLOW_ANY_SGLANG):
        return [Finding(WARN, "SGLang", f"{version} has no adapter here (it serves {served}); "
                                        f"{settings.ALLOW_ANY_SGLANG.name}=1 runs one anyway, at your own risk")]
    return [Finding(FAIL, "SGLang", f"{version} has no adapter in this package (it serves {served}); install one "
                                    "of those releases")]


def plugin_findings(version: Optional[str]) -> list[Finding]:
    """Whether SGLang will load the plugin of ``version``: the entry point is
    installed and ``SGLANG_PLUGINS`` (read as SGLang reads it) allows it."""
    adapter = releases.adapter_for(version) if version else None
    if adapter is None:
        return []
    what = f"plugin {adapter.plugin}"
    points = [e for e in importlib.metadata.entry_points(group=_PLUGIN_GROUP) if e.name == adapter.plugin]
    if not points:
        return [Finding(FAIL, what, f"no {_PLUGIN_GROUP} entry point named {adapter.plugin} in this environment: "
                                    "SGLang cannot load it; pip install this package into SGLang's environment")]
    note = releases.allow_list_note(version)
    if note is not None:
        return [Finding(FAIL, what, note.removeprefix("sglang-cp-hicache: "))]
    allowed = releases.allowed_plugins()
    how = "unset: SGLang loads every plugin" if allowed is None else "allows it"
    return [Finding(OK, what, f"entry point {points[0].value}; {releases.PLUGINS_ENV} {how}")]


def settings_findings() -> list[Finding]:
    """Every setting and SGLang size variable, read as the cache reads them at start-up."""
    try:
        values = settings.check_all()
    except ValueError as exc:
        return [Finding(FAIL, "settings", f"{exc} (python -m sglang_cp_hicache settings lists them all)")]
    return [Finding(OK, "settings", f"{len(values)} variables valid")]


class _ParseError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    """SGLang's parser, but an error is raised to the check instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ParseError(message)


def _import_server_args(version: str) -> tuple[Optional[ModuleType], list[Finding]]:
    """``sglang.srt.server_args``; a missing torchvision (the only import a
    CPU machine lacks) is a FAIL -- the server would fail the same way --
    and the import is retried with this package's import-only stand-in so
    the arguments are still checked."""
    try:
        return importlib.import_module("sglang.srt.server_args"), []
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            return None, [Finding(FAIL, "SGLang import", f"import sglang.srt.server_args failed: {exc}; the "
                                                         "server would fail the same way: repair the environment")]
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    found = Finding(FAIL, "SGLang import", f"SGLang {version} needs torchvision, which cannot be imported: the "
                                           "server would fail to start; install the torchvision build that matches "
                                           "torch (the arguments below were parsed with an import-only stand-in)")
    ensure_sglang_importable()
    try:
        return importlib.import_module("sglang.srt.server_args"), [found]
    except ImportError as exc:
        return None, [found, Finding(FAIL, "SGLang import", f"import sglang.srt.server_args failed: {exc}")]


def parse_launch_args(argv: Sequence[str], module: ModuleType) -> argparse.Namespace:
    """``argv`` through ``module.ServerArgs``' own parser, as SGLang's
    launcher parses it; raises ValueError with the parser's message."""
    parser = _RaisingParser(prog="sglang.launch_server")
    module.ServerArgs.add_cli_args(parser)
    argv = list(argv)
    try:
        if "--config" in argv:  # merged as prepare_server_args merges it
            from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        return parser.parse_args(argv)
    except _ParseError as exc:
        raise ValueError(str(exc)) from None
    except SystemExit:  # --help, --version: the parser printed and stopped
        raise ValueError("the parser stopped (--help or --version among them); pass the server's arguments") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--config: {exc}") from None


def has_adapter_checks(version: Optional[str]) -> bool:
    """Whether an adapter checks the launch arguments of SGLang ``version``."""
    return (version or "") in _ADAPTER_CHECKS


def _adapter_findings(version: str, args: argparse.Namespace) -> list[Finding]:
    name = _ADAPTER_CHECKS.get(version)
    if name is None:
        return [Finding(WARN, "launch arguments", f"not checked against the library's needs: no adapter for "
                                                  f"SGLang {version}")]
    checks: Any = importlib.import_module(name)
    return [Finding(level, what, text) for level, what, text in checks.launch_findings(args)]


def launch_findings(version: str, argv: Sequence[str]) -> tuple[Optional[argparse.Namespace], list[Finding]]:
    """The parsed arguments (None when they could not be parsed) and the findings on them."""
    module, found = _import_server_args(version)
    if module is None:
        return None, found
    try:
        args = parse_launch_args(argv, module)
    except ValueError as exc:
        return None, found + [Finding(FAIL, "launch arguments", f"SGLang {version}'s parser refuses them: {exc}")]
    found.append(Finding(OK, "launch arguments", f"parsed by SGLang {version}'s own parser (ServerArgs.add_cli_args)"
                                                 "; its resolution (ServerArgs.__post_init__: model config, GPU "
                                                 "memory) runs at launch, not here"))
    return args, found + _adapter_findings(version, args)


def kernel_config(version: Optional[str], args: Optional[argparse.Namespace]) -> Optional[dict[str, Any]]:
    """The copy kernels' pool configuration for this server, when known."""
    name = _ADAPTER_CHECKS.get(version or "")
    if name is None or args is None:
        return None
    checks: Any = importlib.import_module(name)
    return checks.kernel_config(args)
