"""Splitting a data set across clients, PFLlib's way, saved to one file every tool reads.

Schemes (``PartitionSpec.parse``): ``dir<alpha>`` (Dirichlet label skew), ``pat<k>`` (k classes per
client), ``iid``. Optionally a seeded class-stratified subsample first (``samples``). Each client's
share is then shuffled and split: 25% test, and of the remaining train share 10% validation (the
hold-out FLAYER's accuracy signal A_l is measured on). Everything follows from the seed.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ClientSplit",
    "Partition",
    "PartitionError",
    "PartitionSpec",
    "format_partition",
    "load_partition",
    "make_partition",
    "save_partition",
    "split_client",
    "stratified_subsample",
]

FORMAT_VERSION = 1


class PartitionError(ValueError):
    """A partition cannot be made as asked, or a saved partition file is malformed."""


@dataclass(frozen=True)
class PartitionSpec:
    kind: str  # "dir" | "pat" | "iid"
    alpha: float = 0.0
    classes_per_client: int = 0

    @classmethod
    def parse(cls, text: str) -> PartitionSpec:
        t = text.strip().lower()
        if t == "iid":
            return cls("iid")
        m = re.fullmatch(r"dir(\d+(?:\.\d+)?)", t)
        if m:
            alpha = float(m.group(1))
            if alpha <= 0:
                raise PartitionError(f"partition {text!r}: Dirichlet alpha must be > 0")
            return cls("dir", alpha=alpha)
        m = re.fullmatch(r"pat(\d+)", t)
        if m and int(m.group(1)) >= 1:
            return cls("pat", classes_per_client=int(m.group(1)))
        raise PartitionError(f"unknown partition {text!r}; use dir<alpha> (e.g. dir0.1), pat<k> (e.g. pat2) or iid")

    def __str__(self) -> str:
        if self.kind == "dir":
            return f"dir{self.alpha:g}"
        if self.kind == "pat":
            return f"pat{self.classes_per_client}"
        return "iid"


@dataclass(frozen=True)
class ClientSplit:
    """Indices into the data set; disjoint within and across clients."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    @property
    def size(self) -> int:
        return int(self.train.size + self.val.size + self.test.size)


@dataclass(frozen=True)
class Partition:
    clients: tuple[ClientSplit, ...]
    summary: dict[str, Any]

    @property
    def num_clients(self) -> int:
        return len(self.clients)


def stratified_subsample(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` indices keeping each class's share (largest-remainder rounding), sorted."""
    if n <= 0:
        raise PartitionError(f"--samples must be positive, got {n}")
    if n >= labels.size:
        return np.arange(labels.size)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * (n / labels.size)
    take = np.floor(quota).astype(np.int64)
    rest = n - int(take.sum())
    order = np.argsort(-(quota - take), kind="stable")
    take[order[:rest]] += 1
    picked = [rng.choice(np.flatnonzero(labels == c), size=int(k), replace=False) for c, k in zip(classes, take)]
    return np.sort(np.concatenate(picked))


def _least_samples(n: int, num_clients: int, batch_size: int, train_ratio: float) -> int:
    """PFLlib's minimum client size: min(batch/(1-train_ratio), N/num_clients/2)."""
    return int(min(batch_size / (1.0 - train_ratio), n / num_clients / 2))


def _dirichlet(labels: np.ndarray, num_clients: int, alpha: float, least: int,
               rng: np.random.Generator, max_tries: int = 10_000) -> list[np.ndarray]:
    """PFLlib's Dirichlet rule: per class, proportions ~ Dir(alpha), clients already holding
    N/num_clients samples get no more; redraw everything until each client has ``least``."""
    n = labels.size
    classes = np.unique(labels)
    for _ in range(max_tries):
        batches: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for k in classes:
            idx_k = rng.permutation(np.flatnonzero(labels == k))
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = p * (sizes < n / num_clients)
            if p.sum() == 0:
                p = np.ones(num_clients)
            p = p / p.sum()
            cuts = (np.cumsum(p) * idx_k.size).astype(np.int64)[:-1]
            for j, part in enumerate(np.split(idx_k, cuts)):
                batches[j].append(part)
                sizes[j] += part.size
        if sizes.min() >= least:
            return [np.concatenate(b) for b in batches]
    raise PartitionError(
        f"Dirichlet({alpha}) could not give each of {num_clients} clients {least} samples in {max_tries} "
        f"draws; use fewer clients, more samples or a larger alpha"
    )


def _pathological(labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client holds ``k`` classes; each class is shared evenly among the clients that hold it."""
    classes = np.unique(labels)
    if k > classes.size:
        raise PartitionError(f"pat{k}: the data set has only {classes.size} classes")
    owners: dict[int, list[int]] = {int(c): [] for c in classes}
    order = rng.permutation(classes)
    for i in range(num_clients):
        for j in range(k):
            owners[int(order[(i * k + j) % classes.size])].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, who in owners.items():
        if not who:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for j, chunk in zip(who, np.array_split(idx, len(who))):
            parts[j].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


def split_client(idx: np.ndarray, test_fraction: float, val_fraction: float,
                 rng: np.random.Generator) -> ClientSplit:
    """One client's indices cut into train / validation (A_l's hold-out) / test, drawn from ``rng``."""
    idx = rng.permutation(idx)
    n_test = int(round(idx.size * test_fraction))
    test, train = idx[:n_test], idx[n_test:]
    n_val = int(round(train.size * val_fraction))
    if val_fraction > 0 and train.size >= 2:
        n_val = max(1, n_val)
    val, train = train[:n_val], train[n_val:]
    return ClientSplit(np.sort(train).astype(np.int64), np.sort(val).astype(np.int64), np.sort(test).astype(np.int64))


def _skew(labels: np.ndarray, clients: list[np.ndarray], num_classes: int) -> dict[str, float]:
    """Label-skew measures: mean total-variation distance between each client's label distribution
    and the global one (0 = iid, 1 = disjoint), and mean number of classes per client."""
    glob = np.bincount(labels, minlength=num_classes) / max(1, labels.size)
    tvs, ncls = [], []
    for c in clients:
        h = np.bincount(labels[c], minlength=num_classes)
        tvs.append(0.5 * np.abs(h / max(1, h.sum()) - glob).sum())
        ncls.append(int((h > 0).sum()))
    return {"mean_tv_distance": float(np.mean(tvs)), "mean_classes_per_client": float(np.mean(ncls))}


def make_partition(labels: np.ndarray, num_classes: int, num_clients: int, spec: PartitionSpec | str,
                   seed: int, samples: int | None = None, test_fraction: float = 0.25,
                   val_fraction: float = 0.1, batch_size: int = 10,
                   meta: dict[str, Any] | None = None) -> Partition:
    """Partition ``labels`` across ``num_clients``; fully determined by the arguments."""
    if isinstance(spec, str):
        spec = PartitionSpec.parse(spec)
    if num_clients < 1:
        raise PartitionError(f"--clients must be >= 1, got {num_clients}")
    if not 0.0 < test_fraction < 1.0 or not 0.0 <= val_fraction < 1.0:
        raise PartitionError("test_fraction must be in (0, 1) and val_fraction in [0, 1)")
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    pool = np.arange(labels.size) if samples is None else stratified_subsample(labels, samples, rng)
    if pool.size < num_clients * 4:
        raise PartitionError(f"{pool.size} samples are too few for {num_clients} clients")
    sub = labels[pool]
    if spec.kind == "dir":
        least = _least_samples(sub.size, num_clients, batch_size, 1.0 - test_fraction)
        local = _dirichlet(sub, num_clients, spec.alpha, least, rng)
    elif spec.kind == "pat":
        local = _pathological(sub, num_clients, spec.classes_per_client, rng)
    else:
        local = list(np.array_split(rng.permutation(sub.size), num_clients))
    shares = [pool[np.sort(c)] for c in local]
    clients = tuple(split_client(s, test_fraction, val_fraction, rng) for s in shares)
    summary: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "partition": str(spec),
        "seed": seed,
        "samples": None if samples is None else int(pool.size),
        "num_clients": num_clients,
        "num_classes": num_classes,
        "test_fraction": test_fraction,
        "val_fraction": val_fraction,
        "skew": _skew(labels, shares, num_classes),
        "clients": [
            {"train": int(c.train.size), "val": int(c.val.size), "test": int(c.test.size),
             "classes": np.bincount(labels[np.concatenate([c.train, c.val, c.test])],
                                    minlength=num_classes).tolist()}
            for c in clients
        ],
    }
    summary.update(meta or {})
    return Partition(clients, summary)


def save_partition(partition: Partition, path: str | Path) -> Path:
    """Write indices and the JSON summary to one ``.npz`` file (no pickle), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        "summary_json": np.frombuffer(json.dumps(partition.summary).encode(), dtype=np.uint8)
    }
    for i, c in enumerate(partition.clients):
        arrays[f"c{i}_train"], arrays[f"c{i}_val"], arrays[f"c{i}_test"] = c.train, c.val, c.test
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
    return path


def load_partition(path: str | Path, dataset_size: int | None = None,
                   fingerprint: str | None = None) -> Partition:
    """Read a partition file, checking its structure (and, if given, that it fits the data set)."""
    path = Path(path)
    if not path.is_file():
        raise PartitionError(f"partition file {path} does not exist; create it with 'flayer partition --save'")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = dict(z.items())
    except Exception as exc:
        raise PartitionError(f"partition file {path} is not a readable .npz file ({exc})") from exc
    try:
        summary = json.loads(bytes(files["summary_json"]).decode())
        n = int(summary["num_clients"])
        if summary.get("format_version") != FORMAT_VERSION:
            raise PartitionError(f"{path}: format version {summary.get('format_version')}, expected {FORMAT_VERSION}")
        clients = tuple(
            ClientSplit(*(np.asarray(files[f"c{i}_{part}"], dtype=np.int64) for part in ("train", "val", "test")))
            for i in range(n)
        )
    except PartitionError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise PartitionError(f"partition file {path} is malformed ({exc!r})") from exc
    allidx = np.concatenate([np.concatenate([c.train, c.val, c.test]) for c in clients])
    if np.unique(allidx).size != allidx.size:
        raise PartitionError(f"partition file {path}: client index sets overlap")
    if dataset_size is not None and allidx.size and (allidx.min() < 0 or allidx.max() >= dataset_size):
        raise PartitionError(f"partition file {path}: indices outside the data set (size {dataset_size})")
    if fingerprint is not None and summary.get("dataset_fingerprint") not in (None, fingerprint):
        raise PartitionError(f"partition file {path} was made for another data set "
                             f"({summary.get('dataset')}, fingerprint {summary.get('dataset_fingerprint')})")
    return Partition(clients, summary)


def format_partition(partition: Partition) -> str:
    """A table of samples and classes per client, with the skew measures."""
    s = partition.summary
    ncls = int(s["num_classes"])
    lines = [f"partition {s['partition']} of {s.get('dataset', '?')}, seed {s['seed']}, "
             f"{partition.num_clients} clients, {sum(c.size for c in partition.clients)} samples"]
    header = f"{'client':>6} {'train':>6} {'val':>5} {'test':>5} {'classes':>7}  label histogram"
    lines.append(header)
    for i, c in enumerate(s["clients"]):
        hist = c["classes"]
        shown = " ".join(f"{h}" for h in hist) if ncls <= 20 else f"{sum(1 for h in hist if h)} non-empty"
        lines.append(f"{i:>6} {c['train']:>6} {c['val']:>5} {c['test']:>5} {sum(1 for h in hist if h):>7}  {shown}")
    sk = s["skew"]
    lines.append(f"skew: mean total-variation distance to the global label mix {sk['mean_tv_distance']:.3f} "
                 f"(0 = iid, 1 = disjoint); mean classes per client {sk['mean_classes_per_client']:.1f}/{ncls}")
    return "\n".join(lines)
