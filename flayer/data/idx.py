"""MNIST and Fashion-MNIST from IDX files (gzipped or not).

Format: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions, then each
dimension as a big-endian uint32, then the data in C order.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from .base import DataError, Dataset

_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

_HOW = {
    "fmnist": "On Debian: apt-get install dataset-fashion-mnist (files land in "
    "/usr/share/datasets/fashion-mnist), or pass --data-dir with the four IDX files.",
    "mnist": "Put the four MNIST IDX files (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
    "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]) in one folder and pass --data-dir.",
}

MAX_IDX_BYTES = 1 << 31


def _find(directory: Path, stem: str, name: str) -> Path:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise DataError(f"{name}: missing IDX file {directory / stem}[.gz]. {_HOW[name]}")


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
    try:
        if head == b"\x1f\x8b":
            with gzip.open(path, "rb") as g:
                data = g.read(MAX_IDX_BYTES + 1)
        else:
            data = path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read gzip IDX file ({exc}); the file is truncated or corrupt") from exc
    if len(data) > MAX_IDX_BYTES:
        raise DataError(f"{path}: larger than {MAX_IDX_BYTES} bytes; not an MNIST-style IDX file")
    return data


def read_idx(path: Path, expected_ndim: int) -> np.ndarray:
    """Parse one IDX file of unsigned bytes; raise DataError on any mismatch."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes, too short for an IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0:
        raise DataError(f"{path}: bad IDX magic {data[:2].hex()} (expected 0000); not an IDX file")
    if dtype_code != 0x08:
        raise DataError(f"{path}: IDX type code 0x{dtype_code:02x}, expected 0x08 (unsigned byte)")
    if ndim != expected_ndim:
        raise DataError(f"{path}: IDX file has {ndim} dimensions, expected {expected_ndim}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes, need {header})")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    count = int(np.prod(np.asarray(dims, dtype=np.int64)))
    if any(d == 0 for d in dims) or count != len(data) - header:
        raise DataError(
            f"{path}: IDX header announces shape {dims} ({count} bytes) but the file holds "
            f"{len(data) - header} data bytes; the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load_idx_dataset(name: str, directory: Path) -> Dataset:
    if not directory.is_dir():
        raise DataError(f"{name}: data directory {directory} does not exist. {_HOW[name]}")
    parts = {key: _find(directory, stem, name) for key, stem in _FILES.items()}
    xs, ys = [], []
    for split in ("train", "test"):
        x = read_idx(parts[f"{split}_x"], 3)
        y = read_idx(parts[f"{split}_y"], 1)
        if x.shape[0] != y.shape[0]:
            raise DataError(f"{name}: {parts[split + '_x']} has {x.shape[0]} images but "
                            f"{parts[split + '_y']} has {y.shape[0]} labels")
        if y.max() >= 10:
            raise DataError(f"{name}: {parts[split + '_y']} has label {int(y.max())}; expected 0..9")
        xs.append(x)
        ys.append(y)
    x_all = np.concatenate(xs)[:, None, :, :]
    y_all = np.concatenate(ys).astype(np.int64)
    return Dataset(name=name, x=np.ascontiguousarray(x_all), y=y_all, num_classes=10)
