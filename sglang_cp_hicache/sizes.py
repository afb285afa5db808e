"""Sizes, ratios and flags as SGLang reads them, stdlib only, so that
``settings.check_all`` can parse every such value before any rank starts
(without importing torch or SGLang).

* :func:`parse_file_size`: SGLang's file backend (``HiCacheFile``'s
  ``max_size`` / ``min_free_space``, via ``human_readable_int``): bytes, or a
  number with a case-sensitive SI (``k M G T``) or IEC (``Ki Mi Gi Ti``,
  whole numbers only) suffix. SGLang *disables* the bound on a value it
  cannot read; this library refuses it instead, naming SGLang's forms.
* :func:`parse_eviction_ratio`: its ``eviction_ratio``, a number in (0, 1]
  (SGLang silently uses 0.9 outside that range; refused here).
* :func:`parse_mooncake_size`: SGLang's Mooncake ``global_segment_size``:
  bytes or ``<n>gb`` (case-insensitive), plus this library's ``<n>mb``.
* :func:`parse_mooncake_flag`: SGLang's ``EnvBool`` words.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Optional

__all__ = [
    "FILE_SIZE_FORMS", "MOONCAKE_FLAG_FALSE", "MOONCAKE_FLAG_FORMS", "MOONCAKE_FLAG_TRUE", "MOONCAKE_SIZE_FORMS",
    "RATIO_FORMS", "parse_eviction_ratio", "parse_file_size", "parse_mooncake_flag", "parse_mooncake_size",
]

#: What an error says a file-backend size may be (SGLang's forms, nothing more).
FILE_SIZE_FORMS = ("bytes (1048576), or a number with a case-sensitive SI suffix k, M, G, T (200G, 1.5T) "
                   "or IEC suffix Ki, Mi, Gi, Ti (64Gi; whole numbers only)")
RATIO_FORMS = "a number in (0, 1] such as 0.9"
MOONCAKE_SIZE_FORMS = "bytes (4294967296) or <n>gb (4gb, GiB units)"
MOONCAKE_FLAG_TRUE = ("true", "1", "yes", "y")
MOONCAKE_FLAG_FALSE = ("false", "0", "no", "n")
MOONCAKE_FLAG_FORMS = "/".join(MOONCAKE_FLAG_TRUE) + " or " + "/".join(MOONCAKE_FLAG_FALSE)

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")  # human_readable_int's own pattern
_GIB = 1 << 30
_MIB = 1 << 20


def _bad_size(name: str, value: object, why: str = "") -> ValueError:
    return ValueError(f"{name} must be a size as SGLang's file backend reads it: {FILE_SIZE_FORMS}; "
                      f"got {value!r}{why}")


def parse_file_size(name: str, value: object) -> int:
    """A byte size exactly as SGLang's file backend reads it (None, empty
    or 0: no bound); refuses, naming ``name`` and SGLang's forms, a value
    SGLang would not read and a negative one (which SGLang takes as no bound)."""
    if value is None:
        return 0
    if isinstance(value, bool):  # SGLang would read True as 1 byte: a mistake, not a size
        raise _bad_size(name, value)
    if isinstance(value, (int, float)):  # JSON / TOML numbers of the extra config
        if not math.isfinite(value) or value < 0:
            raise _bad_size(name, value)
        return int(value)
    if not isinstance(value, str):
        raise _bad_size(name, value)
    text = value.strip()
    if not text or text == "0":
        return 0
    found = _SUFFIXED.fullmatch(text)
    if found is not None:
        number, suffix = found.groups()
        if suffix in _IEC:
            if "." in number:
                raise _bad_size(name, value, f" (decimals only with SI suffixes: {number}{suffix[0]})")
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])  # Decimal, as SGLang: 4.35G is 4350000000 exactly
    try:
        size = int(text)  # int()'s forms, as SGLang: "+5", "1_000"
    except ValueError:
        raise _bad_size(name, value) from None
    if size < 0:
        raise _bad_size(name, value, " (negative)")
    return size


def parse_eviction_ratio(name: str, value: object) -> float:
    """An eviction ratio as SGLang's file backend reads it (None: 0.9);
    refuses, naming ``name``, what SGLang would replace by 0.9."""
    if value is None:
        return 0.9
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {RATIO_FORMS}, got {value!r}")
    try:
        ratio = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {RATIO_FORMS}, got {value!r}") from None
    if not 0.0 < ratio <= 1.0:  # also refuses nan
        raise ValueError(f"{name} must be {RATIO_FORMS}, got {value!r}")
    return ratio


def parse_mooncake_size(name: str, value: object, minimum: int = 1) -> int:
    """A byte count as SGLang's Mooncake backend reads it: an int (or a whole
    float, as JSON / YAML may give one), ``"<n>gb"`` (2**30 bytes each) or a
    number as text (``int()``'s forms); and ``"<n>mb"``, which this library
    also reads. Case and surrounding spaces do not matter."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count, got bool")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        text = value.strip().lower()
        scale = _GIB if text.endswith("gb") else _MIB if text.endswith("mb") else 1
        digits = text[:-2].strip() if scale > 1 else text
        try:
            size = int(digits) * scale
        except ValueError:
            raise ValueError(f"{name} must be a byte count as SGLang's Mooncake backend reads it: "
                             f"{MOONCAKE_SIZE_FORMS}; got {value!r}") from None
    else:
        raise TypeError(f"{name} must be an int or text such as '4gb', got {type(value).__name__}")
    if size < minimum:
        raise ValueError(f"{name} must be at least {minimum} bytes, got {size}")
    return size


def parse_mooncake_flag(name: str, value: object) -> Optional[bool]:
    """A Mooncake boolean in SGLang's words (None / empty: unset)."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if not text:
        return None
    if text in MOONCAKE_FLAG_TRUE + MOONCAKE_FLAG_FALSE:
        return text in MOONCAKE_FLAG_TRUE
    raise ValueError(f"{name} must be a boolean ({MOONCAKE_FLAG_FORMS}), got {value!r}")
