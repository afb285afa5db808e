"""A fleet's deployments: ``--deployment RELEASE:cpN[:device=D][:host=H]``,
and the Python that runs each release.

Each SGLang release lives in its own environment, so each deployment's
ranks are started by its own release's interpreter: ``.venv`` (0.5.18) and
``.venv-0523`` (0.5.23) at the root of the checkout this package was
imported from (what ``make install`` builds), the running interpreter when
its SGLang is that release, or ``--python RELEASE=PATH``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from sglang_cp_hicache.sim.config import SGLANG_VERSIONS

__all__ = ["VENVS", "DeploymentSpec", "parse_deployment", "parse_python", "python_for"]

#: Where each release's environment lives in a checkout.
VENVS = {"0.5.18": ".venv", "0.5.23": ".venv-0523"}
#: The checkout this package was imported from.
ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment: its release, CP size and (None: sized from the trace) pools per rank."""

    release: str
    cp_size: int
    device_pages: Optional[int] = None
    host_pages: Optional[int] = None

    def name(self, position: int) -> str:
        """A unique name in the fleet: ``d0-0.5.18-cp2``."""
        return f"d{position}-{self.release}-cp{self.cp_size}"


def _positive(flag: str, text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{flag}: {what} must be a positive integer, got {text!r}")
    return value


def parse_deployment(text: str) -> DeploymentSpec:
    """``RELEASE:cpN[:device=D][:host=H]``; ValueError naming ``--deployment``."""
    flag = f"--deployment {text}"
    parts = text.split(":")
    if len(parts) < 2 or not parts[1].startswith("cp"):
        raise ValueError(f"{flag}: expected RELEASE:cpN[:device=D][:host=H], e.g. 0.5.23:cp4")
    release = parts[0]
    if release not in SGLANG_VERSIONS:
        raise ValueError(f"{flag}: the release must be one of {', '.join(SGLANG_VERSIONS)}, got {release!r}")
    cp_size = _positive(flag, parts[1][2:], "the CP size")
    if release == "0.5.23" and cp_size < 2:
        raise ValueError(f"{flag}: SGLang 0.5.23's sharded pool needs cp2 or more")
    pools: dict[str, int] = {}
    for part in parts[2:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("device", "host") or key in pools:
            raise ValueError(f"{flag}: {part!r} is not device=D or host=H (each at most once)")
        pools[key] = _positive(flag, value, f"{key} pages per rank")
    return DeploymentSpec(release, cp_size, pools.get("device"), pools.get("host"))


def parse_python(text: str) -> tuple[str, str]:
    """``--python RELEASE=PATH``."""
    release, sep, path = text.partition("=")
    if not sep or release not in SGLANG_VERSIONS or not path:
        raise ValueError(f"--python {text}: expected RELEASE=PATH with RELEASE one of {', '.join(SGLANG_VERSIONS)}")
    return release, path


def python_for(release: str, overrides: Mapping[str, str], installed: str) -> str:
    """The interpreter that runs ``release``'s deployments; ValueError (naming
    ``--deployment`` and ``--python``) when there is none."""
    if release in overrides:
        path = overrides[release]
        source = f"--python {release}={path}"
    elif release == installed:
        return sys.executable
    else:
        path = os.fspath(ROOT / VENVS[release] / "bin" / "python")
        source = f"the {VENVS[release]} environment of {ROOT}"
    if not os.access(path, os.X_OK):
        raise ValueError(f"--deployment {release}: no Python to run SGLang {release}: {path} ({source}) is missing "
                         f"or not executable (make install builds it; or pass --python {release}=PATH)")
    return path
