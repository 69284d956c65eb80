"""CIFAR-10 and CIFAR-100 from the standard "python version" pickle batches.

CIFAR-10: ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``, each a pickled dict with
``data`` (10000 x 3072 uint8, channel-major 32x32) and ``labels``. CIFAR-100: ``cifar-100-python/
train`` and ``test`` with ``data`` and ``fine_labels``. The files are pickles, so they are read with
an unpickler that only admits the handful of types those files contain (no arbitrary code).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from .base import DataError, Dataset, require_file

_HOW = {
    "cifar10": "Download 'CIFAR-10 python version' (cifar-10-python.tar.gz), extract it and pass "
    "--data-dir .../cifar-10-batches-py.",
    "cifar100": "Download 'CIFAR-100 python version' (cifar-100-python.tar.gz), extract it and pass "
    "--data-dir .../cifar-100-python.",
}

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def _load_batch(path: Path, label_key: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        obj = _RestrictedUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure is a malformed file
        raise DataError(f"{name}: {path} is not a readable CIFAR python batch ({exc}). {_HOW[name]}") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{name}: {path} holds a {type(obj).__name__}, expected a dict batch")
    batch = {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "data" not in batch or label_key not in batch:
        raise DataError(f"{name}: {path} lacks keys 'data' and {label_key!r} (found {sorted(batch)})")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{name}: {path} 'data' is {data.dtype} {data.shape}, expected uint8 (N, 3072)")
    if labels.shape != (data.shape[0],):
        raise DataError(f"{name}: {path} has {data.shape[0]} images but {labels.shape[0]} labels")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar(name: str, directory: Path) -> Dataset:
    if not directory.is_dir():
        raise DataError(f"{name}: data directory {directory} does not exist. {_HOW[name]}")
    if name == "cifar10":
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        label_key, classes = "labels", 10
    else:
        files, label_key, classes = ["train", "test"], "fine_labels", 100
    xs, ys = [], []
    for f in files:
        x, y = _load_batch(require_file(directory / f, name, _HOW[name]), label_key, name)
        xs.append(x)
        ys.append(y)
    y_all = np.concatenate(ys)
    if y_all.size and (y_all.min() < 0 or y_all.max() >= classes):
        raise DataError(f"{name}: labels outside 0..{classes - 1} in {directory}")
    return Dataset(name=name, x=np.ascontiguousarray(np.concatenate(xs)), y=y_all, num_classes=classes,
                   mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
