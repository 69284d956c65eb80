"""Data sets from their standard on-disk formats; nothing is downloaded.

``load_dataset(name, data_dir)`` returns a :class:`Dataset`: images as uint8 (N, C, H, W) or token
ids as int64 (N, T), labels as int64. Train and test files are concatenated, as PFLlib does before
partitioning across clients (each client then splits its own share 75/25).
"""

from __future__ import annotations

from pathlib import Path

from .agnews import load_agnews
from .base import DataError, Dataset
from .cifar import load_cifar
from .digits import load_digits
from .idx import load_idx_dataset
from .tiny_imagenet import load_tiny_imagenet

__all__ = ["DATASETS", "DataError", "Dataset", "default_data_dir", "load_dataset"]

DATASETS = ("fmnist", "mnist", "digits", "cifar10", "cifar100", "tiny-imagenet", "agnews")

_DEFAULT_DIRS = {
    "fmnist": "/usr/share/datasets/fashion-mnist",
    "mnist": "/usr/share/datasets/mnist",
    "cifar10": "data/cifar-10-batches-py",
    "cifar100": "data/cifar-100-python",
    "tiny-imagenet": "data/tiny-imagenet-200",
    "agnews": "data/ag_news_csv",
}


def default_data_dir(name: str) -> Path | None:
    d = _DEFAULT_DIRS.get(name)
    return Path(d) if d else None


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """Load data set ``name`` from ``data_dir`` (or its default directory)."""
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "digits":
        return load_digits()
    path = Path(data_dir) if data_dir is not None else default_data_dir(name)
    assert path is not None
    if name in ("fmnist", "mnist"):
        return load_idx_dataset(name, path)
    if name in ("cifar10", "cifar100"):
        return load_cifar(name, path)
    if name == "tiny-imagenet":
        return load_tiny_imagenet(path)
    return load_agnews(path)
