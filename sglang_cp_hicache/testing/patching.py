"""Reversible attribute patches for the CPU harnesses (both SGLang releases).

A plan is a list of ``(owner, attribute, make_replacement(original))``;
:class:`PatchSet` applies it once, remembers whether each owner held the
attribute itself or inherited it (or lacked it), and puts everything back.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

__all__ = ["PatchPlan", "PatchSet"]

PatchPlan = Iterable[tuple[Any, str, Callable[[Any], Any]]]

_MISSING = object()


class PatchSet:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        # (owner, name) -> (original, whether the owner held it itself), in install order
        self._originals: dict[tuple[Any, str], tuple[Any, bool]] = {}

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def apply(self, plan: PatchPlan) -> None:
        """Apply every patch of ``plan`` (call under :attr:`lock`, once)."""
        for owner, name, make in plan:
            own = vars(owner).get(name, _MISSING)
            self._originals[(owner, name)] = (own, own is not _MISSING)
            setattr(owner, name, make(getattr(owner, name, None)))

    def undo(self) -> None:
        """Restore every patched attribute, newest first."""
        with self.lock:
            for (owner, name), (original, owned) in reversed(list(self._originals.items())):
                if owned:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)  # it was inherited (or absent): unshadow it
            self._originals.clear()
