"""Tiny-ImageNet-200 from its standard folder layout.

``tiny-imagenet-200/wnids.txt`` (one WordNet id per class), ``train/<wnid>/images/*.JPEG`` (500 per
class) and ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt`` (tab-separated: file name,
wnid, box). Train and val are concatenated (the unlabelled test folder is not used). 64x64 RGB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .base import DataError, Dataset, require_file

_HOW = ("Download tiny-imagenet-200.zip, extract it and pass --data-dir .../tiny-imagenet-200 "
        "(it must contain wnids.txt, train/ and val/).")


def _read_image(path: Path) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError("tiny-imagenet: Pillow is needed to decode JPEG files (pip install pillow)") from exc
    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # PIL raises many types for bad files
        raise DataError(f"tiny-imagenet: cannot decode image {path} ({exc})") from exc
    if arr.shape != (64, 64, 3):
        raise DataError(f"tiny-imagenet: image {path} is {arr.shape[1]}x{arr.shape[0]}, expected 64x64")
    return arr.transpose(2, 0, 1)


def load_tiny_imagenet(directory: Path) -> Dataset:
    if not directory.is_dir():
        raise DataError(f"tiny-imagenet: data directory {directory} does not exist. {_HOW}")
    wnids_file = require_file(directory / "wnids.txt", "tiny-imagenet", _HOW)
    wnids = [w.strip() for w in wnids_file.read_text().splitlines() if w.strip()]
    if len(wnids) < 2 or len(set(wnids)) != len(wnids):
        raise DataError(f"tiny-imagenet: {wnids_file} must list distinct class ids, one per line")
    label_of = {w: i for i, w in enumerate(wnids)}
    items: list[tuple[Path, int]] = []
    for w in wnids:
        folder = directory / "train" / w / "images"
        if not folder.is_dir():
            raise DataError(f"tiny-imagenet: missing folder {folder}. {_HOW}")
        items.extend((p, label_of[w]) for p in sorted(folder.glob("*.JPEG")))
    ann = require_file(directory / "val" / "val_annotations.txt", "tiny-imagenet", _HOW)
    for lineno, line in enumerate(ann.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label_of:
            raise DataError(f"tiny-imagenet: {ann}:{lineno}: expected 'file<TAB>wnid...' with a wnid from "
                            f"wnids.txt, got {line[:80]!r}")
        items.append((directory / "val" / "images" / fields[0], label_of[fields[1]]))
    if not items:
        raise DataError(f"tiny-imagenet: no images found under {directory}. {_HOW}")
    x = np.empty((len(items), 3, 64, 64), dtype=np.uint8)
    for i, (p, _) in enumerate(items):
        x[i] = _read_image(p)
    y = np.asarray([label for _, label in items], dtype=np.int64)
    return Dataset(name="tiny-imagenet", x=x, y=y, num_classes=len(wnids), mean=(0.5, 0.5, 0.5),
                   std=(0.5, 0.5, 0.5), class_names=tuple(wnids))
