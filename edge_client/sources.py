"""A device's own data: an image folder, an arrays file or a Python entry point, turned into its
seeded train / validation / test split (:class:`flayer.train.ClientData`).

Every check names the path, what was expected and what was found. What depends on the federation
(the input size, the class list, the normalisation) comes from the round plan's
:class:`~flayer.spec.ModelSpec`, so :func:`check_source` validates what it can before the device
connects and :func:`load_source` finishes once the first plan names the model. Nothing here sends
data anywhere: the device reports counts and metrics only.

- ``folder``: ``<root>/<class name>/*.png|jpg|jpeg``; class folders must be names of the plan's
  class list; images decoded with Pillow, checked against the model's input (``resize = true``:
  resized and converted to its mode instead).
- ``arrays``: one ``.npz`` or ``.safetensors`` file holding ``x`` and ``y``; uint8 images
  (N, C, H, W) are normalised as the plan says, float inputs are used as they are.
- ``python``: ``"package.module:function"`` called with ``args``, returning a torch ``Dataset`` of
  (input, label) pairs or a (train, val, test) triple of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flayer.data import DataError
from flayer.partition import split_client
from flayer.registry import ModelError, resolve_entry_point
from flayer.spec import ModelSpec
from flayer.train import ClientData, Split

__all__ = [
    "IMAGE_SUFFIXES",
    "MAX_SAMPLES",
    "DeviceSource",
    "SourceConfig",
    "check_source",
    "load_source",
    "scan_folder",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MAX_SAMPLES = 2_000_000  # bounds what a python source or an arrays file may hand the device
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


@dataclass(frozen=True)
class SourceConfig:
    """The ``[data]`` table of a device whose data is its own (``source`` folder, arrays or python)."""

    source: str
    path: str = ""  # folder or arrays file (resolved)
    entry: str = ""  # python source
    args: Mapping[str, Any] | None = None
    resize: bool = False
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    seed: int = 0


def scan_folder(root: Path) -> dict[str, list[Path]]:
    """Class name -> image files (sorted) of an image folder; DataError on any layout problem."""
    if not root.is_dir():
        raise DataError(f"data folder {root}: not found (expected <folder>/<class name>/*.png or *.jpg)")
    classes: dict[str, list[Path]] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if not entry.is_dir():
            raise DataError(f"data folder {root}: expected only class folders, found file {entry.name!r}")
        files = sorted(p for p in entry.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        others = sorted(p.name for p in entry.iterdir() if p.suffix.lower() not in IMAGE_SUFFIXES
                        and not p.name.startswith("."))
        if others:
            raise DataError(f"class folder {entry}: expected only {'/'.join(IMAGE_SUFFIXES)} images, found "
                            f"{others[:3]}")
        if not files:
            raise DataError(f"class folder {entry}: expected images (*.png, *.jpg), found none")
        classes[entry.name] = files
    if not classes:
        raise DataError(f"data folder {root}: empty (expected <folder>/<class name>/*.png or *.jpg)")
    return classes


def _decode(path: Path, spec: ModelSpec, resize: bool) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    mode = _MODES.get(spec.in_channels)
    if mode is None:
        raise DataError(f"image folders feed models with 1, 3 or 4 input channels; the plan's has {spec.in_channels}")
    try:
        with Image.open(path) as im:
            im.load()
            if resize:
                im = im.convert(mode).resize((spec.width, spec.height), Image.Resampling.BILINEAR)
            elif im.mode != mode or im.size != (spec.width, spec.height):
                raise DataError(f"image {path}: expected {spec.width}x{spec.height} {mode} (the model's input), found "
                                f"{im.size[0]}x{im.size[1]} {im.mode}; convert it, or set resize = true in [data]")
            arr = np.asarray(im, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise DataError(f"image {path}: cannot be decoded ({exc})") from None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _load_folder(root: Path, spec: ModelSpec, resize: bool) -> tuple[np.ndarray, np.ndarray]:
    classes = scan_folder(root)
    index = {n: i for i, n in enumerate(spec.class_names)}
    unknown = sorted(set(classes) - set(index))
    if unknown:
        raise DataError(f"data folder {root}: class folder(s) {unknown} are not in the federation's classes "
                        f"{list(index)}")
    total = sum(len(v) for v in classes.values())
    if total > MAX_SAMPLES:
        raise DataError(f"data folder {root}: {total} images; at most {MAX_SAMPLES} are read")
    xs, ys = [], []
    for name, files in classes.items():
        for f in files:
            xs.append(_decode(f, spec, resize))
            ys.append(index[name])
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


def _read_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"arrays file {path}: not found (expected a .npz or .safetensors file holding x and y)")
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                found = dict(z.items())
        elif path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            found = load_file(str(path))
        else:
            raise DataError(f"arrays file {path}: expected a .npz or .safetensors file, found suffix {path.suffix!r}")
    except DataError:
        raise
    except Exception as exc:  # numpy/safetensors raise many kinds for a bad file
        raise DataError(f"arrays file {path}: unreadable ({type(exc).__name__}: {exc})") from exc
    missing = sorted({"x", "y"} - set(found))
    if missing:
        raise DataError(f"arrays file {path}: expected arrays x and y, found {sorted(found)}")
    return found["x"], found["y"]


def _from_dataset(ds: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of a torch Dataset of (input, label) pairs (at most MAX_SAMPLES)."""
    try:
        n = len(ds)
    except TypeError:
        raise DataError(f"{where}: expected a torch Dataset with a length, found {type(ds).__name__}") from None
    if n > MAX_SAMPLES:
        raise DataError(f"{where}: {n} samples; at most {MAX_SAMPLES} are read")
    xs, ys = [], []
    for i in range(n):
        item = ds[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataError(f"{where}: sample {i} is {type(item).__name__}; expected an (input, label) pair")
        xs.append(torch.as_tensor(item[0]).numpy())
        ys.append(int(torch.as_tensor(item[1]).item()))
    if not xs:
        return np.zeros((0,)), np.zeros((0,), np.int64)
    shapes = {x.shape for x in xs}
    if len(shapes) > 1:
        raise DataError(f"{where}: inputs of different shapes {sorted(shapes)[:3]}")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


def _call_python(cfg: SourceConfig) -> Any:
    fn = _entry(cfg.entry)
    try:
        return fn(**dict(cfg.args or {}))
    except Exception as exc:  # the user's code: any failure is one clear error
        raise DataError(f"python source {cfg.entry!r} raised {type(exc).__name__}: {exc}") from exc


def _entry(entry: str) -> Any:
    try:
        return resolve_entry_point(entry)
    except ModelError as exc:
        raise DataError(f"python source: {exc}") from None


def _check_xy(x: np.ndarray, y: np.ndarray, spec: ModelSpec, where: str) -> None:
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise DataError(f"{where}: x and y must be arrays")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise DataError(f"{where}: y must be one integer label per sample, found shape {y.shape} dtype {y.dtype}")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{where}: {x.shape[0]} inputs but {y.shape[0]} labels")
    if x.shape[0] > MAX_SAMPLES:
        raise DataError(f"{where}: {x.shape[0]} samples; at most {MAX_SAMPLES} are read")
    if y.size and (y.min() < 0 or y.max() >= spec.num_classes):
        bad = int(y[(y < 0) | (y >= spec.num_classes)][0])
        raise DataError(f"{where}: label {bad} is outside the federation's class list (labels 0..{spec.num_classes - 1}"
                        f": {list(spec.class_names)})")
    if spec.is_text:
        if x.ndim != 2 or x.dtype.kind not in "iu":
            raise DataError(f"{where}: the plan's model takes token ids (N, T) integers, found {x.shape} {x.dtype}")
        return
    want = (spec.in_channels, spec.height, spec.width)
    if tuple(x.shape[1:]) != want or (x.dtype != np.uint8 and x.dtype.kind != "f"):
        raise DataError(f"{where}: the plan's model takes inputs of shape (N, {', '.join(map(str, want))}) uint8 or "
                        f"float, found {x.shape} {x.dtype}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise DataError(f"{where}: x holds NaN or Inf values")


def _split(x: np.ndarray, y: np.ndarray, spec: ModelSpec) -> Split:
    if x.dtype == np.uint8 and not spec.is_text:
        mean = torch.full((1, spec.in_channels, 1, 1), float(spec.mean))
        std = torch.full((1, spec.in_channels, 1, 1), float(spec.std))
        return Split(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64)), mean, std)
    xt = torch.from_numpy(np.ascontiguousarray(x if spec.is_text else x.astype(np.float32)))
    return Split(xt, torch.from_numpy(y.astype(np.int64)), None, None)


def _checked(x: np.ndarray, y: np.ndarray, spec: ModelSpec, where: str) -> Split:
    _check_xy(x, y, spec, where)
    return _split(x, y, spec)


def check_source(cfg: SourceConfig) -> None:
    """What can be checked before the plan is known: the folder's layout, the arrays file's contents,
    the python entry point's import."""
    if cfg.source == "folder":
        scan_folder(Path(cfg.path))
    elif cfg.source == "arrays":
        x, y = _read_arrays(Path(cfg.path))
        if y.ndim != 1 or x.shape[:1] != y.shape:
            raise DataError(f"arrays file {cfg.path}: x {x.shape} and y {y.shape} must hold one label per input")
    elif cfg.source == "python":
        _entry(cfg.entry)
    else:
        raise DataError(f"unknown data source {cfg.source!r}")


def load_source(cfg: SourceConfig, spec: ModelSpec) -> ClientData:
    """This device's data for the plan's model: checked, split (seeded) into train / val / test."""
    if cfg.source == "python":
        got = _call_python(cfg)
        where = f"python source {cfg.entry!r}"
        if isinstance(got, (tuple, list)) and len(got) == 3:
            parts = [_checked(*_from_dataset(d, f"{where} ({n})"), spec, f"{where} ({n})")
                     for d, n in zip(got, ("train", "val", "test"))]
            if len(parts[0]) == 0:
                raise DataError(f"{where}: the train part is empty")
            return ClientData(*parts)
        x, y = _from_dataset(got, where)
    elif cfg.source == "folder":
        where = f"data folder {cfg.path}"
        x, y = _load_folder(Path(cfg.path), spec, cfg.resize)
    elif cfg.source == "arrays":
        where = f"arrays file {cfg.path}"
        x, y = _read_arrays(Path(cfg.path))
    else:
        raise DataError(f"unknown data source {cfg.source!r}")
    whole = _checked(x, y, spec, where)
    if len(whole) < 3:
        raise DataError(f"{where}: {len(whole)} samples; a device needs at least 3 (train, validation, test)")
    cut = split_client(np.arange(len(whole)), cfg.test_fraction, cfg.val_fraction, np.random.default_rng(cfg.seed))
    return ClientData(*(whole.subset(torch.from_numpy(i)) for i in (cut.train, cut.val, cut.test)))



class DeviceSource:
    """A device's own data, loaded for the plan's model the first time it is needed, then kept
    (loaded again only if a plan names another model input or class list)."""

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg
        self._key: tuple[Any, ...] | None = None
        self._data: ClientData | None = None

    @property
    def loaded(self) -> ClientData | None:
        return self._data

    def for_spec(self, spec: ModelSpec) -> ClientData:
        key = (spec.name, spec.in_channels, spec.height, spec.width, spec.num_classes, spec.classes, spec.mean,
               spec.std, spec.vocab_size)
        if key != self._key or self._data is None:
            self._data = load_source(self.cfg, spec)
            self._key = key
        return self._data
