"""The README is the way in: short, status first, the plugin names and
settings it documents are the real ones."""

import pathlib
import re
import tomllib

from sglang_cp_hicache import settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_says_its_status_first():
    lines = README.splitlines()
    assert len(lines) <= 300, len(lines)
    head = "\n".join(lines[:50])  # the status section carries the generated "What you get" block
    assert "## Status" in head
    assert "no GPU figures" in head and "Not run on a real server" in head
    assert "make install" in head and "make test" in README


def test_the_readme_names_every_setting_and_the_real_plugin_names():
    for s in settings.SETTINGS:
        assert f"`{s.name}`" in README, s.name
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    for name in declared:
        assert f"`{name}`" in README, name
    assert "--radix-cache-backend cp-hicache" in README and "cp_hicache`" in README


def test_the_018_notes_spell_the_backend_as_registered():
    notes = (ROOT / "docs" / "sglang-0.5.18-notes.md").read_text()
    assert "radix-cache-backend cp_hicache" not in notes
    assert not re.search(r'register_radix_cache_backend\("cp_hicache"', notes)


def test_ci_runs_the_readme_s_two_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make install\nmake test\n" in ci


def test_the_license_is_the_one_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
