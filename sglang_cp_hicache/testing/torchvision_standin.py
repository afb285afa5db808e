"""An in-memory, import-only ``torchvision`` stand-in for CPU-only machines.

``import sglang`` needs ``torchvision`` (through model configs and
transformers), and torchvision's PyPI wheel is a CUDA build that cannot load
on a CPU build of torch (installing it swaps torch for a multi-GB CUDA build).
:func:`ensure_sglang_importable` registers this stand-in for the current
process ONLY when ``import torchvision`` fails. Nothing is written to disk;
every stand-in callable raises ``RuntimeError`` and every unknown attribute
``AttributeError``, so vision code fails loudly instead of misbehaving. It is
the project's only torchvision stand-in, for every SGLang release the harness
drives.
"""

from __future__ import annotations

import enum
import importlib
import importlib.machinery
import sys
import types
from typing import Any, Callable

__all__ = ["TORCHVISION_STANDIN_VERSION", "ensure_sglang_importable", "torchvision_standin_installed"]

TORCHVISION_STANDIN_VERSION = "0.0.0+sglang-cp-hicache-standin"
_STANDIN_MARK = "__sglang_cp_hicache_standin__"


class _InterpolationMode(enum.Enum):
    # Values as in torchvision.transforms.InterpolationMode; transformers'
    # image_utils maps PIL resampling onto these members at import time.
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def _unavailable(qualname: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{qualname} is not available: torchvision could not be imported, and "
            "sglang_cp_hicache.testing.torchvision_standin.ensure_sglang_importable() registered "
            "an import-only stand-in for this process"
        )

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = stub.__name__
    return stub


# Exactly the names SGLang 0.5.18's import chain (sglang/__init__, server_args,
# mem_cache.*, managers.cache_controller / schedule_policy / schedule_batch)
# pulls from torchvision, directly or through transformers 5.12.1:
#   sglang/srt/utils/common.py:95            from torchvision.io import decode_jpeg
#   transformers/image_utils.py:54-56        ImageReadMode, decode_image,
#                                            InterpolationMode, pil_to_tensor
#   transformers/image_processing_utils.py:48,
#   transformers/image_processing_backends.py:74   torchvision.transforms.v2.functional
#   sglang/srt/configs/deepseek_ocr.py:7-8   transforms.InterpolationMode, transforms.functional
#   sglang/srt/multimodal/internvl_utils.py:7  transforms.functional.InterpolationMode
_STANDIN_MODULES: dict[str, dict[str, Any]] = {
    "torchvision": {"__version__": TORCHVISION_STANDIN_VERSION},
    "torchvision.io": {
        "decode_jpeg": _unavailable("torchvision.io.decode_jpeg"),
        "decode_image": _unavailable("torchvision.io.decode_image"),
        "ImageReadMode": _ImageReadMode,
    },
    "torchvision.transforms": {"InterpolationMode": _InterpolationMode},
    "torchvision.transforms.functional": {
        "InterpolationMode": _InterpolationMode,
        "pil_to_tensor": _unavailable("torchvision.transforms.functional.pil_to_tensor"),
    },
    "torchvision.transforms.v2": {},
    "torchvision.transforms.v2.functional": {},
}


def _standin_getattr(module_name: str) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        raise AttributeError(
            f"module {module_name!r} is an import-only stand-in registered by "
            "sglang_cp_hicache.testing.torchvision_standin.ensure_sglang_importable() because "
            f"torchvision could not be imported; it has no attribute {name!r}"
        )

    return __getattr__


def torchvision_standin_installed() -> bool:
    """True when ``sys.modules['torchvision']`` is this module's stand-in."""
    module = sys.modules.get("torchvision")
    return bool(getattr(module, _STANDIN_MARK, False))


def _torchvision_importable() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # a CUDA wheel against CPU torch raises more than ImportError
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]  # drop a half-initialised package before standing in
        return False
    return True


def _install_torchvision_standin() -> None:
    modules: dict[str, types.ModuleType] = {}
    for name, attrs in _STANDIN_MODULES.items():
        module = types.ModuleType(name, "Import-only torchvision stand-in (sglang_cp_hicache).")
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []  # a package: submodule imports resolve via sys.modules
        module.__getattr__ = _standin_getattr(name)  # type: ignore[method-assign]
        setattr(module, _STANDIN_MARK, True)
        for attr, value in attrs.items():
            setattr(module, attr, value)
        modules[name] = module
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    sys.modules.update(modules)


def ensure_sglang_importable() -> bool:
    """Import ``sglang``; returns True if a torchvision stand-in was needed.

    ONLY if ``import torchvision`` fails (not installed, or a CUDA wheel that
    cannot load on a CPU build of torch), this registers an in-memory,
    import-only stand-in package under ``sys.modules['torchvision']`` (plus the
    five submodules SGLang 0.5.18's import chain touches) for the rest of this
    process. Nothing is written to disk or installed; every stand-in callable
    raises ``RuntimeError`` when called and every other attribute raises
    ``AttributeError``, so vision code fails loudly instead of misbehaving.
    Because the stand-in has a module spec, transformers reports torchvision
    as available and imports the names above from it.
    """
    standin = False
    if not torchvision_standin_installed() and not _torchvision_importable():
        _install_torchvision_standin()
        standin = True
    importlib.import_module("sglang")
    return standin or torchvision_standin_installed()
