"""The in-memory data set every loader returns, and the one error they raise."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..spec import ModelSpec


class DataError(Exception):
    """A data set is missing or malformed; the message names the path, what was expected and how
    to obtain it."""


@dataclass(frozen=True)
class Dataset:
    """A whole data set in memory.

    ``x``: uint8 images (N, C, H, W), or int64 token ids (N, T) with 0 = padding for text.
    ``y``: int64 labels in [0, num_classes). ``mean``/``std`` normalise images after scaling to
    [0, 1] (PFLlib uses 0.5/0.5 for every image set).
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    vocab_size: int = 0
    class_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(f"{self.name}: {self.x.shape[0]} inputs but {self.y.shape[0]} labels")
        if self.y.size and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise DataError(f"{self.name}: labels outside [0, {self.num_classes})")

    @property
    def is_text(self) -> bool:
        return self.x.ndim == 2

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def fingerprint(self) -> str:
        """A short digest of the labels and input shape: a saved partition checks it on load."""
        h = hashlib.sha256()
        h.update(self.name.encode())
        h.update(np.asarray(self.x.shape, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.y, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def model_spec(self, model: str | None = None) -> ModelSpec:
        """The model this data set trains by default (FedAvgCNN for images, fastText for text)."""
        name = model or ("fasttext" if self.is_text else "cnn")
        if self.is_text:
            if name != "fasttext":
                raise DataError(f"{self.name} is a text data set: use model 'fasttext', not {name!r}")
            return ModelSpec(name=name, num_classes=self.num_classes, vocab_size=self.vocab_size)
        if name == "fasttext":
            raise DataError(f"{self.name} is an image data set: 'fasttext' needs text")
        _, c, h, w = self.x.shape
        return ModelSpec(name=name, in_channels=c, height=h, width=w, num_classes=self.num_classes)


def require_file(path: Path, what: str, how: str) -> Path:
    """Return ``path`` if it is a file, else raise DataError naming it, what and how to get it."""
    if not path.is_file():
        raise DataError(f"{what}: missing file {path}. {how}")
    return path
