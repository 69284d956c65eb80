"""sklearn's 8x8 handwritten digits (1,797 images, shipped inside the scikit-learn wheel).

Images are upsampled 2x (nearest) to 1x16x16, the smallest size FedAvgCNN's two 5x5 convolutions
accept, and rescaled from 0..16 to 0..255.

The wheel's ``sklearn/datasets/data/digits.csv.gz`` is read directly (as sklearn's own ``load_digits``
reads it): importing ``sklearn.datasets`` costs about a second of CPU in every process that loads the
data set (each edge device, coordinator and emulator worker). Where that file is not found, sklearn's
loader is used.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from .base import DataError, Dataset


def _digits_csv() -> Path | None:
    """The digits file inside the installed scikit-learn, without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _images_and_labels() -> tuple[np.ndarray, np.ndarray]:
    """(N, 8, 8) float64 images in 0..16 and int labels, as ``sklearn.datasets.load_digits`` gives them."""
    path = _digits_csv()
    if path is not None:
        with gzip.open(path, mode="rt", encoding="utf-8") as fh:
            data = np.loadtxt(fh, delimiter=",")
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    try:
        from sklearn.datasets import load_digits as _sk_load
    except ImportError as exc:
        raise DataError("digits: scikit-learn is not installed; pip install 'flayer-edge[digits]'") from exc
    bunch = _sk_load()
    return bunch.images, bunch.target


def load_digits() -> Dataset:
    images, target = _images_and_labels()
    small = np.asarray(images, dtype=np.float64)  # (N, 8, 8), 0..16
    big = np.kron(small, np.ones((2, 2)))  # (N, 16, 16)
    x = np.clip(np.rint(big * (255.0 / 16.0)), 0, 255).astype(np.uint8)[:, None]
    return Dataset(name="digits", x=np.ascontiguousarray(x), y=np.asarray(target, dtype=np.int64),
                   num_classes=10)
