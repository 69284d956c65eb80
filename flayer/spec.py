"""The description of a model architecture that travels in round plans and model files (no torch).

A model is named by a built-in name (``cnn``, ``resnet18``, ``fasttext``: see
:data:`flayer.registry.BUILTIN_MODELS`) or by an entry point ``"package.module:function"`` that
returns an ``nn.Module`` when called with the keyword arguments ``args``. Every value is a scalar
(the round plan carries scalars only): ``args`` and ``classes`` are canonical JSON strings.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["BUILTIN_NAMES", "ENTRY_POINT", "MAX_SPEC_TEXT", "ModelSpec", "canonical_args", "canonical_classes"]

# the built-in models (their builders are registered in flayer.registry, the same way a user model is)
BUILTIN_NAMES = ("cnn", "resnet18", "fasttext")
ENTRY_POINT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
MAX_SPEC_TEXT = 256  # a round plan's strings are at most this long
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def canonical_args(args: Any, where: str = "args") -> str:
    """``args`` (a mapping of JSON values) as the canonical JSON text a ModelSpec holds."""
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"{where} must be a table of keyword arguments, got {args!r}")
    try:
        text = json.dumps(args, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} must hold JSON values only (strings, numbers, booleans, lists, tables): {exc}") \
            from None
    return "" if text == "{}" else text


def canonical_classes(names: Any, where: str = "classes") -> str:
    """A list of distinct, non-empty class names as the JSON text a ModelSpec holds."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{where} must be a list of non-empty class names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{where} repeats a class name: {list(names)}")
    return json.dumps(list(names), separators=(",", ":")) if names else ""


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a model on another machine (sent in the round plan).

    ``in_channels``/``height``/``width``: the image input (a device resizes or checks its images
    to it); ``mean``/``std``: the normalisation after scaling pixels to [0, 1]; ``classes``: the
    federation's class names in label order (JSON list; empty: labels are 0..num_classes-1);
    ``fingerprint``: sha256 of the architecture (ordered tensor names, shapes, dtypes), set by the
    coordinator; a device whose build differs refuses the plan.
    """

    name: str
    in_channels: int = 1
    height: int = 28
    width: int = 28
    num_classes: int = 10
    vocab_size: int = 0
    hidden_dim: int = 32
    stem: str = "imagenet"
    args: str = ""
    classes: str = ""
    mean: float = 0.5
    std: float = 0.5
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not (self.name in BUILTIN_NAMES or ENTRY_POINT.fullmatch(self.name)):
            raise ValueError(f"unknown model {self.name!r}; choose one of {', '.join(BUILTIN_NAMES)} or name an entry "
                             f"point \"package.module:function\"")
        for key in ("name", "args", "classes"):
            if len(getattr(self, key)) > MAX_SPEC_TEXT:
                raise ValueError(f"model {key} is {len(getattr(self, key))} characters; a round plan carries at most "
                                 f"{MAX_SPEC_TEXT}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.name == "fasttext" and self.vocab_size < 2:
            raise ValueError("fasttext needs vocab_size >= 2")
        if min(self.in_channels, self.height, self.width) < 1:
            raise ValueError(f"in_channels, height and width must be >= 1, got {self.in_channels}x{self.height}x"
                             f"{self.width}")
        if not self.std > 0:
            raise ValueError(f"std must be > 0, got {self.std}")
        if self.fingerprint and not _FINGERPRINT.fullmatch(self.fingerprint):
            raise ValueError("fingerprint must be 64 lowercase hex characters (sha256)")
        if self.args:
            canonical_args(json.loads(self.args))
        if self.classes and len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for num_classes = {self.num_classes}")

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_NAMES

    @property
    def is_text(self) -> bool:
        """Token-id inputs (fastText) rather than images."""
        return self.name == "fasttext"

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(json.loads(self.args)) if self.args else {}

    @property
    def class_names(self) -> tuple[str, ...]:
        if self.classes:
            return tuple(json.loads(self.classes))
        return tuple(str(i) for i in range(self.num_classes))
