"""``python -m sglang_cp_hicache`` / ``sglang-cp-hicache``: command-line entry."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional, Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from sglang_cp_hicache import __version__
    from sglang_cp_hicache.preflight import add_check_parser
    from sglang_cp_hicache.sim.cli import add_simulate_parser
    from sglang_cp_hicache.sim.fleet.cli import add_fleet_parser

    parser = argparse.ArgumentParser(
        prog="sglang-cp-hicache",
        allow_abbrev=False,
        description="Context-parallel (CP shared KV) HiCache for SGLang 0.5.18 and 0.5.23 DSA models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_simulate_parser(sub)
    add_fleet_parser(sub)
    shown = sub.add_parser(
        "settings", help="the installed SGLang release, the plugin that will load, and the environment "
                         "variables this library reads that are set, with the values in force (exit 2 on "
                         "an invalid one)"
    )
    shown.add_argument("--all", action="store_true", dest="show_all",
                       help="every setting, set or not, with its default and meaning")
    shown.set_defaults(func=_show_settings)
    add_check_parser(sub)
    return parser


def _show_settings(args: argparse.Namespace) -> int:
    import importlib.metadata

    from sglang_cp_hicache import releases, settings

    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    plugins = frozenset(ep.name for ep in importlib.metadata.entry_points(group="sglang.srt.plugins"))
    print(releases.plugin_line(installed, plugins))
    print(settings.describe(everything=args.show_all))
    note = releases.allow_list_note(installed)
    if note is not None:  # not an invalid setting of ours: said, exit status unchanged
        print(f"warning: {note}")
    for warning in settings.unknown_names():  # a misspelt name reads as unset: said, not fatal
        print(f"warning: {warning}")
    try:
        settings.check_all()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the launcher, which stops the ranks


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
