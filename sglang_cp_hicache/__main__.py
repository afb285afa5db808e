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

    parser = argparse.ArgumentParser(
        prog="sglang-cp-hicache",
        allow_abbrev=False,
        description="Context-parallel (CP shared KV) HiCache for SGLang 0.5.18 and 0.5.23 DSA models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_simulate_parser(sub)
    shown = sub.add_parser(
        "settings", help="the environment variables this library reads, with the values in force"
    )
    shown.set_defaults(func=_show_settings)
    add_check_parser(sub)
    return parser


def _show_settings(args: argparse.Namespace) -> int:
    import importlib.metadata

    from sglang_cp_hicache import releases, settings

    print(settings.describe())
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    note = releases.allow_list_note(installed)
    if note is not None:  # not an invalid setting of ours: said, exit status unchanged
        print(f"warning: {note}")
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
