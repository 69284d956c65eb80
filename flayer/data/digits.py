"""sklearn's 8x8 handwritten digits (1,797 images, shipped inside the scikit-learn wheel).

Images are upsampled 2x (nearest) to 1x16x16, the smallest size FedAvgCNN's two 5x5 convolutions
accept, and rescaled from 0..16 to 0..255.
"""

from __future__ import annotations

import numpy as np

from .base import DataError, Dataset


def load_digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits as _sk_load
    except ImportError as exc:
        raise DataError("digits: scikit-learn is not installed; pip install 'flayer-edge[digits]'") from exc
    bunch = _sk_load()
    small = np.asarray(bunch.images, dtype=np.float64)  # (N, 8, 8), 0..16
    big = np.kron(small, np.ones((2, 2)))  # (N, 16, 16)
    x = np.clip(np.rint(big * (255.0 / 16.0)), 0, 255).astype(np.uint8)[:, None]
    return Dataset(name="digits", x=np.ascontiguousarray(x), y=np.asarray(bunch.target, dtype=np.int64),
                   num_classes=10)
