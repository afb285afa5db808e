"""Both releases' check that SGLang's plugin loader loads exactly the
plugins of this package that ``SGLANG_PLUGINS`` allows."""

from __future__ import annotations

from typing import Iterable

import pytest

__all__ = ["assert_loaded_as_allowed"]


def assert_loaded_as_allowed(monkeypatch: pytest.MonkeyPatch, allow_lists: Iterable[str]) -> None:
    """For each ``SGLANG_PLUGINS`` value, the installed SGLang's loader loads
    exactly this package's plugins ``releases.plugin_allowed`` says."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    from sglang_cp_hicache import releases

    ours = {r.plugin for r in releases.RELEASES}
    for value in allow_lists:
        monkeypatch.setenv("SGLANG_PLUGINS", value)
        loaded = set(load_plugins_by_group(GENERAL_PLUGINS_GROUP)) & ours
        assert loaded == {p for p in ours if releases.plugin_allowed(p)}, value
