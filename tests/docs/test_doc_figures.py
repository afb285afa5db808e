"""Measured figures in docs/simulator.md and docs/sglang-0.5.23.md come from
bench/results/ through scripts/render_results.py (docs/results.md, the
README's generated blocks), never copied by hand: the sections that report
results carry none, and the stale ones an operator found stay out
(docs/testing.md, rule 9)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: What a hand-copied measurement looks like: 1,118 / 0.459 / 185 MB / 20.0 % / 113 s.
FIGURE = re.compile(r"\b\d+(?:\.\d+)? ?(?:%|MB|GB|CPU-s|s\b)|\b\d{1,3}(?:,\d{3})+\b"
                    r"|(?<![\d.])\d+\.\d+(?![\d.])")
#: The sections that report results: (file, heading).
RESULT_SECTIONS = (
    ("simulator.md", "### Figures"),
    ("sglang-0.5.23.md", "### The library against upstream, one command"),
    ("sglang-0.5.23.md", "### Figures: lost backups and host hits, same workload on both paths"),
)


def _section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same or a higher level."""
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    rest = text[start + len(heading) + 1:]
    stop = re.search(rf"^#{{1,{len(level)}}} ", rest, flags=re.M)
    return rest[:stop.start()] if stop else rest


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (commands, example output)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def figures(text: str) -> list[str]:
    return FIGURE.findall(_prose(text))


def test_the_figure_pattern_catches_hand_copied_measurements_and_spares_commands():
    assert figures("wrote 1,118 pages (185 MB), 20.0 % each, hit_ratio 0.459, in 113 s") == [
        "1,118", "185 MB", "20.0 %", "0.459", "113 s"]
    assert figures("SGLang 0.5.23, CP 4, page 64\n```\n--requests 1,000 0.995\n```\n") == []


@pytest.mark.parametrize("name,heading", RESULT_SECTIONS)
def test_result_sections_carry_no_hand_written_figure(name, heading):
    section = _section((DOCS / name).read_text(), heading)
    assert figures(section) == [], f"{name}, {heading}: generate these from bench/results/ or drop them"


@pytest.mark.parametrize("stale", [
    "CLI wiring is pending",  # --copy and --compare-upstream exist
    "185 MB",  # the L3 write run's objects (and a wrong figure)
    "**396** (396)",  # the library's host reads before it freed request pages from their rotation
    "the library before this round 396",
    "864 / 881",
])
def test_stale_figures_stay_out(stale):
    for name in ("simulator.md", "sglang-0.5.23.md"):
        assert stale not in (DOCS / name).read_text(), (name, stale)
