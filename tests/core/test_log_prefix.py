"""One log prefix: every message the library logs or prints under its own
name starts ``sglang-cp-hicache`` (an operator greps for one word), never
the shorter ``cp-hicache`` some modules used."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "sglang_cp_hicache"
#: A string literal (any prefix: f, r, b) that opens with the short name as a message prefix.
SHORT = re.compile(r"""^[a-zA-Z]*["']{1,3}cp-hicache[: ]""")


def test_no_message_starts_with_the_short_prefix():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        found += [f"{path.relative_to(PACKAGE)}:{tok.start[0]}" for tok in tokens
                  if tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_START", -1)) and SHORT.match(tok.string)]
    assert found == []
