"""Optional dependencies of the export package, each named with the extra that installs it.

Nothing here imports a heavy package at module import time: a device that only trains with torch
never needs onnx or executorch installed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingDependency", "require", "require_executorch", "require_onnx"]

# extra -> the modules it provides (pyproject.toml [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "export": ("onnx", "onnxruntime", "onnxscript"),
    "executorch": ("executorch", "executorch.exir", "executorch.runtime"),
}


class MissingDependency(ImportError):
    """An optional dependency is not importable; the message names the extra to install."""

    def __init__(self, module: str, extra: str, purpose: str, cause: BaseException | None = None) -> None:
        detail = f" ({cause})" if cause is not None else ""
        super().__init__(f"{purpose} needs the Python package '{module}', which is not importable{detail}; "
                         f"install it with: pip install 'flayer-edge[{extra}]'")
        self.module = module
        self.extra = extra


def require(extra: str, purpose: str) -> dict[str, ModuleType]:
    """Import every module of ``extra``; raise :class:`MissingDependency` naming the first missing one."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    out: dict[str, ModuleType] = {}
    for name in EXTRAS[extra]:
        try:
            out[name] = importlib.import_module(name)
        except ImportError as exc:
            raise MissingDependency(name, extra, purpose, exc) from exc
    return out


def require_onnx() -> dict[str, ModuleType]:
    return require("export", "ONNX export")


def require_executorch() -> dict[str, ModuleType]:
    return require("executorch", "ExecuTorch export")
