"""A partition file for a large simulated fleet: N devices of ``--per-device`` images, each device's labels
drawn from its own Dirichlet(alpha) class mix (Hsu, Qi and Brown 2019), for ``flayer simulate
--partition-file``.

PFLlib's rule (``flayer partition --partition dir0.1``) draws per class over the devices and redraws until
every device holds a minimum; at 1,000 devices of Fashion-MNIST with alpha 0.1 it finds no such draw. Here
device i draws p_i ~ Dir(alpha) over the classes and takes its images class by class from what is left of
the pool (a class that runs out is dropped from its mix and the rest renormalised), devices in a seeded
order; each device's images are then split into train / validation / test as ``flayer partition`` does
(25% test, 10% of the rest validation)::

    python benchmarks/partition_devices.py --devices 1000 --per-device 70 --alpha 0.1 \\
        --save docs/results/privacy-fmnist-1000/partition.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_device_dirichlet(labels: np.ndarray, devices: int, per_device: int, alpha: float,
                         rng: np.random.Generator) -> list[np.ndarray]:
    """``devices`` disjoint index sets of ``per_device`` images, each from its own Dir(alpha) class mix."""
    classes = np.unique(labels)
    pools = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    if devices * per_device > labels.size:
        raise ValueError(f"{devices} x {per_device} images is more than the {labels.size} the data set holds")
    out = []
    for _ in range(devices):
        p = rng.dirichlet(np.full(classes.size, alpha))
        take: list[int] = []
        while len(take) < per_device:
            left = np.array([len(pools[int(c)]) for c in classes], dtype=float)
            q = p * (left > 0)
            q = q / q.sum() if q.sum() > 0 else left / left.sum()
            counts = np.minimum(rng.multinomial(per_device - len(take), q), left.astype(int))
            for c, k in zip(classes, counts):
                take += [pools[int(c)].pop() for _ in range(int(k))]
            p = q
        out.append(np.sort(np.asarray(take, dtype=np.int64)))
    return out


def main() -> int:
    from flayer.data import load_dataset
    from flayer.partition import FORMAT_VERSION, Partition, _skew, save_partition, split_client

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--per-device", type=int, default=70)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", type=Path, required=True)
    a = p.parse_args()
    if a.devices < 1 or a.per_device < 4 or not a.alpha > 0:
        p.error("--devices >= 1, --per-device >= 4 and --alpha > 0 are needed")
    ds = load_dataset(a.dataset, a.data_dir)
    labels = np.asarray(ds.y, dtype=np.int64)
    rng = np.random.default_rng(a.seed)
    shares = per_device_dirichlet(labels, a.devices, a.per_device, a.alpha, rng)
    clients = tuple(split_client(s, 0.25, 0.1, rng) for s in shares)
    summary = {"format_version": FORMAT_VERSION, "partition": f"per-device dir{a.alpha:g}", "seed": a.seed,
               "samples": int(sum(s.size for s in shares)), "num_clients": a.devices, "num_classes": ds.num_classes,
               "test_fraction": 0.25, "val_fraction": 0.1, "skew": _skew(labels, shares, ds.num_classes),
               "dataset": ds.name, "dataset_fingerprint": ds.fingerprint(),
               "clients": [{"train": int(c.train.size), "val": int(c.val.size), "test": int(c.test.size),
                            "classes": np.bincount(labels[s], minlength=ds.num_classes).tolist()}
                           for c, s in zip(clients, shares)]}
    save_partition(Partition(clients, summary), a.save)
    print(f"{a.save}: {a.devices} devices x {a.per_device} images, skew {summary['skew']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
