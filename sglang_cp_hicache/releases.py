"""Which SGLang release each adapter serves, under which plugin name, and
what each plugin says when it starts on a release that is not its own.

SGLang loads every installed ``sglang.srt.plugins`` entry point in each
process, so both of this package's plugins run on every server: the one for
the running release does the work, the other must say so in words that are
right for that release (never advice that only holds for its own release).

SGLang's ``SGLANG_PLUGINS`` is an allow-list of entry point *names*: empty or
unset loads every plugin; otherwise a plugin whose name is not in the
comma-separated list is skipped (SGLang logs that at INFO only). A name
missing from it therefore serves upstream's path without this library, so
a plugin that does run checks that its sibling for the running release was
not left out.

Core: no sglang import; a plugin passes the running release's version in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from sglang_cp_hicache import settings

__all__ = [
    "PLUGINS_ENV", "RELEASES", "ReleaseAdapter", "adapter_for", "adapter_for_plugin", "allow_list_note",
    "allowed_plugins", "left_out_warning", "not_my_release", "plugin_allowed", "plugin_line",
]

#: SGLang's allow-list of general plugins (``sglang.srt.plugins``).
PLUGINS_ENV = settings.SGLANG_PLUGINS.name


@dataclass(frozen=True)
class ReleaseAdapter:
    """One adapter: the release it was written against, its entry point name
    (``pyproject.toml``) and how a server of that release turns it on."""

    sglang_version: str
    plugin: str
    turn_on: str


RELEASES: tuple[ReleaseAdapter, ...] = (
    ReleaseAdapter(
        "0.5.18",
        "cp_hicache",
        "--enable-hierarchical-cache --radix-cache-backend cp-hicache, on a server whose token "
        "allocator is the CP shared one (CpSharedPagedTokenToKVPoolAllocator)",
    ),
    ReleaseAdapter(
        "0.5.23",
        "cp_hicache_0523",
        "nothing to pass: a PD prefill server with --enable-kv-cache-sharding and "
        "--enable-hierarchical-cache gets the library's copy path",
    ),
)


def check_sglang_version(supported: str, version: str) -> None:
    """Refuse SGLang ``version`` where the adapter for ``supported`` runs (it
    was not written against it). The library's ``ALLOW_ANY_SGLANG`` setting
    turns the error into a no-op (at your own risk: the adapter's hook check
    still runs when a cache is built)."""
    if version != supported and not settings.enabled(settings.ALLOW_ANY_SGLANG):
        raise RuntimeError(
            f"sglang-cp-hicache's SGLang {supported} adapter supports sglang=={supported}, found {version}; "
            f"set {settings.ALLOW_ANY_SGLANG.name}=1 to try anyway"
        )


def adapter_for(version: str) -> Optional[ReleaseAdapter]:
    """The adapter written for SGLang ``version``, or None."""
    return next((r for r in RELEASES if r.sglang_version == version), None)


def adapter_for_plugin(plugin: str) -> ReleaseAdapter:
    """The adapter behind entry point ``plugin``; KeyError for an unknown name."""
    for r in RELEASES:
        if r.plugin == plugin:
            return r
    raise KeyError(f"no adapter has the plugin name {plugin!r}")


def _raw_allow_list(environ: Optional[Mapping[str, str]]) -> str:
    # Untrimmed, as SGLang tests it: a value of only spaces or commas is
    # "set" there and allows no plugin at all.
    return (os.environ if environ is None else environ).get(PLUGINS_ENV, "")


def allowed_plugins(environ: Optional[Mapping[str, str]] = None) -> Optional[frozenset[str]]:
    """The names ``SGLANG_PLUGINS`` allows, read as SGLang reads it (split on
    commas, each name stripped, empty names dropped); None when it allows
    every plugin (unset or empty)."""
    raw = _raw_allow_list(environ)
    if not raw:
        return None
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


def plugin_allowed(plugin: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether SGLang loads the plugin named ``plugin`` under ``SGLANG_PLUGINS``."""
    allowed = allowed_plugins(environ)
    return allowed is None or plugin in allowed


def left_out_warning(plugin: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The warning for a server whose ``SGLANG_PLUGINS`` leaves ``plugin`` out,
    or None when SGLang loads it."""
    if plugin_allowed(plugin, environ):
        return None
    adapter = adapter_for_plugin(plugin)
    return (
        f"sglang-cp-hicache: {PLUGINS_ENV}={_raw_allow_list(environ)!r} leaves out {plugin!r}, the plugin for "
        f"SGLang {adapter.sglang_version}: this server runs without sglang-cp-hicache (SGLang's own cache "
        f"path); add {plugin} to {PLUGINS_ENV} or unset it"
    )


def allow_list_note(version: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """For ``python -m sglang_cp_hicache settings``: the warning when
    ``SGLANG_PLUGINS`` leaves out the plugin of the installed SGLang release
    ``version`` (None: no SGLang, or a release no adapter serves)."""
    adapter = adapter_for(version) if version else None
    return left_out_warning(adapter.plugin, environ) if adapter is not None else None


def not_my_release(plugin: str, version: str, environ: Optional[Mapping[str, str]] = None) -> tuple[bool, str]:
    """What ``plugin`` says when it starts on SGLang ``version``, which is not
    its own release: ``(is_warning, text)``.

    * a release another adapter of this package serves: which plugin serves
      it (a warning instead when ``SGLANG_PLUGINS`` leaves that plugin out);
    * any other release: this package has nothing for it (a warning).
    """
    mine = adapter_for_plugin(plugin)
    other = adapter_for(version)
    if other is not None and other.plugin != plugin:
        left_out = left_out_warning(other.plugin, environ)
        if left_out is not None:
            return True, left_out
        return False, (
            f"sglang-cp-hicache: the SGLang {mine.sglang_version} adapter ({plugin}) does nothing on "
            f"SGLang {version}; the plugin {other.plugin} serves it ({other.turn_on})"
        )
    served = ", ".join(r.sglang_version for r in RELEASES)
    return True, (
        f"sglang-cp-hicache: SGLang {version} has no adapter in this package (it serves {served}); "
        f"the SGLang {mine.sglang_version} adapter ({plugin}) registers nothing"
    )


def plugin_line(version: Optional[str], installed_plugins: frozenset[str],
                environ: Optional[Mapping[str, str]] = None) -> str:
    """For ``python -m sglang_cp_hicache settings``: the installed SGLang
    release (``version``; None: none) and which of this package's plugins
    SGLang will load for it, given the entry point names installed in
    ``sglang.srt.plugins`` and ``SGLANG_PLUGINS``."""
    if version is None:
        return "SGLang is not installed here: no plugin of this package loads"
    adapter = adapter_for(version)
    if adapter is None:
        served = ", ".join(r.sglang_version for r in RELEASES)
        return f"SGLang {version} installed: no plugin of this package serves it (it serves {served})"
    head = f"SGLang {version} installed: plugin {adapter.plugin}"
    if adapter.plugin not in installed_plugins:  # e.g. the package on PYTHONPATH, never pip-installed
        return f"{head} will not load (its entry point is not installed: pip install this package)"
    raw = _raw_allow_list(environ)
    if not raw:
        return f"{head} will load ({PLUGINS_ENV} unset: every installed plugin loads)"
    if plugin_allowed(adapter.plugin, environ):
        return f"{head} will load ({PLUGINS_ENV}={raw!r} names it)"
    return f"{head} will NOT load ({PLUGINS_ENV}={raw!r} leaves it out)"
