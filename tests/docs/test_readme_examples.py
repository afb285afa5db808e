"""Every example value the README's settings table (and each setting's own
meaning text, which ``settings --all`` prints) shows is a value SGLang
accepts, checked with SGLang's own parser where it has one (lifted from the
installed SGLang; skipped without it) and with the library's."""

from __future__ import annotations

import pathlib
import re

import pytest

from sglang_cp_hicache import settings, sizes
from tests.helpers.sglang_parsers import sglang_file_size, sglang_parsers

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BY_NAME = {s.name: s for s in settings.SETTINGS}
FILE_SIZES = (settings.FILE_MAX_SIZE, settings.FILE_MIN_FREE)
FLAG_WORDS = {"0/1", "true/false", "yes/no", "on/off"}
#: A size written in prose: a number and a unit.
SIZE_WORD = re.compile(r"\b\d+(?:\.\d+)?(?:Ki|Mi|Gi|Ti|k|M|G|T|gb|mb|GB|MB)\b")


def table_rows() -> list[tuple[list[settings.Setting], list[str]]]:
    """The settings table: (settings a row names, the backticked examples of its "valid" column)."""
    rows = []
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = [BY_NAME[n] for n in re.findall(r"`([A-Z0-9_]+)`", cells[0]) if n in BY_NAME]
        if line.startswith("|") and len(cells) == 4 and names:
            rows.append((names, re.findall(r"`([^`]+)`", cells[2])))
    return rows


def library_accepts(setting: settings.Setting, value: str) -> bool:
    try:
        settings.check_value(setting, {setting.name: value})
    except ValueError:
        return False
    return True


def sglang_accepts(setting: settings.Setting, value: str) -> bool:
    parsers = sglang_parsers()
    if parsers is None:
        pytest.skip("SGLang is not installed")
    if setting in FILE_SIZES:
        return sglang_file_size(parsers, value) is not None
    if setting is settings.FILE_EVICTION_RATIO:  # EnvFloat, then SGLang's (0, 1] range (else 0.9)
        try:
            return 0.0 < float(value) <= 1.0
        except ValueError:
            return False
    if setting is settings.MOONCAKE_SEGMENT_SIZE:
        try:
            return parsers["_parse_global_segment_size"](value) > 0
        except ValueError:
            return False
    return True  # no SGLang parser: the library's check is the check


def test_the_table_rows_are_found_and_the_file_backend_row_shows_sizes():
    rows = table_rows()
    assert {s for names, _ in rows for s in names} == set(settings.SETTINGS)
    examples = next(ex for names, ex in rows if settings.FILE_MAX_SIZE in names)
    assert [e for e in examples if SIZE_WORD.fullmatch(e)], examples


def test_every_example_in_the_table_is_a_value_sglang_and_the_library_accept():
    for names, examples in table_rows():
        for example in examples:
            if example in FLAG_WORDS:  # the library's own flag words, each side of the slash
                assert all(names[0].is_flag and w in names[0].choices for w in example.split("/")), example
                continue
            if any(s.choices for s in names):
                assert all(example in s.choices for s in names), (names, example)
                continue
            takers = [s for s in names if s.name in settings._PARSED and library_accepts(s, example)]
            parsed_row = [s for s in names if s.name in settings._PARSED]
            if parsed_row:  # a row of sizes / ratios: each example fits one of its variables, both ways
                assert takers, f"no variable of {[s.name for s in names]} takes the README's {example!r}"
                assert all(sglang_accepts(s, example) for s in takers), (example, takers)
        for s in names:  # a size / ratio variable shown with no example of its own form is a gap
            if s.name in settings._PARSED and s.name.startswith("SGLANG_HICACHE_FILE"):
                assert any(library_accepts(s, e) for e in examples), (s.name, examples)


@pytest.mark.parametrize("setting", [s for s in settings.SETTINGS if s.name in settings._PARSED],
                         ids=lambda s: s.name)
def test_the_sizes_each_setting_s_meaning_shows_are_values_sglang_accepts(setting):
    words = SIZE_WORD.findall(setting.meaning)
    for word in words:
        assert library_accepts(setting, word), (setting.name, word)
        assert sglang_accepts(setting, word), (setting.name, word)


def test_the_operator_s_100gb_is_refused_by_both_naming_sglang_s_forms():
    assert not sglang_accepts(settings.FILE_MAX_SIZE, "100gb")
    with pytest.raises(ValueError, match="SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE='100gb' is not valid; use bytes"):
        settings.check_all({settings.FILE_MAX_SIZE.name: "100gb"})
    assert "100gb" not in README
    assert sizes.FILE_SIZE_FORMS in settings.describe({settings.FILE_MAX_SIZE.name: "100gb"})


def test_the_readme_lists_every_dependency_pyproject_declares():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in declared:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0]
        assert f"`{name}" in README, name
