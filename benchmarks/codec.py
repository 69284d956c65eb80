"""Sparse-update codec: bytes against the information limit, and encode/decode speed.

Rows:
- synthetic: ResNet-18's float state (11.2M coordinates, 102 tensors), a uniformly random mask of
  density 1%, 10%, 50% in every tensor, N(0, 1e-3) fp32 deltas;
- FLAYER on Fashion-MNIST: one FedAvg local round (lr 0.005, batch 10, one epoch) of FedAvgCNN on a
  Dirichlet(0.1) client shard, then FLAYER's layer-wise top-|change| masks (UP_i = min(max(i/L, 0.1), 1)).

Columns: position bits / sum_t n_t H(p_t) (the information limit of each tensor's mask, given its
count), position bits per sent coordinate, encoded bytes against dense fp32 and against int32 index +
fp32 value, and encode / decode throughput in MB/s of the dense fp32 size (the best of --repeats).

    python benchmarks/codec.py [--repeats 3] [--seed 0] [--data-dir DIR] [--skip-fmnist]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: its packages first

from flayer.layers import layer_plan
from flayer.models import ModelSpec, build_model
from flayer.update import TensorDelta, Update, delta_update, float_state, state_numpy
from protocol import UpdateHeader, UpdateOptions, decode_update, encode_update, entropy_bits
from protocol.sparse import encode_best

HEADER = UpdateHeader("bench", 1, "client-0", "0" * 64)


def _best(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(label: str, update: Update, options: UpdateOptions, repeats: int) -> list[str]:
    numel = update.numel
    sent = update.sent
    pos_bits = sum(
        8 * len(encode_best(d.indices, d.numel, options.zstd_masks)[2]) for d in update.deltas.values()
    )
    limit = sum(entropy_bits(d.numel, d.count) for d in update.deltas.values())
    enc_s, blob = _best(lambda: encode_update(update, HEADER, options), repeats)
    assert isinstance(blob, bytes)
    shapes = {k: d.shape for k, d in update.deltas.items()}
    dec_s, _ = _best(lambda: decode_update(blob, shapes=shapes), repeats)
    dense = 4 * numel
    sparse_ref = 8 * sent
    mb = dense / 1e6
    values = (
        options.values
        + (" +zstd" if options.zstd else "")
        + ("" if options.zstd_masks else ", no zstd masks")
    )
    return [
        label,
        f"{numel / 1e6:.2f}M",
        f"{sent / numel:.1%}",
        values,
        f"{pos_bits / limit:.3f}" if limit else "-",
        f"{pos_bits / max(sent, 1):.2f}",
        f"{len(blob) / 1e6:.3f} MB",
        f"{len(blob) / dense:.3f}",
        f"{len(blob) / sparse_ref:.3f}",
        f"{mb / enc_s:.0f}",
        f"{mb / dec_s:.0f}",
    ]


def random_update(shapes: Mapping[str, tuple[int, ...]], density: float, rng: np.random.Generator) -> Update:
    deltas = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        m = max(1, int(round(density * numel)))
        idx = np.sort(rng.choice(numel, size=m, replace=False)).astype(np.int64)
        deltas[name] = TensorDelta(shape, (rng.standard_normal(m) * 1e-3).astype(np.float32), idx)
    return Update(deltas, 100)


def flayer_masks(
    local: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, torch.Tensor | None]:
    """Layer-wise masks: layer i of L keeps the fraction UP_i = min(max(i/L, 0.1), 1) of its weights
    with the largest |local - global| (top-k over the layer's tensors together). Mirrors FLAYER's
    Eq. 5-9 mask; to be replaced by flayer's own mask function once it is available."""
    plan = layer_plan(model)
    masks: dict[str, torch.Tensor | None] = {}
    for layer in plan.layers:
        up = min(max(layer.index / plan.num_layers, 0.1), 1.0)
        names = layer.tensors
        if up >= 1.0:
            masks.update({n: None for n in names})
            continue
        change = torch.cat([(local[n] - global_state[n]).abs().reshape(-1) for n in names])
        k = max(1, math.ceil(up * change.numel()))
        keep = torch.zeros(change.numel(), dtype=torch.bool)
        keep[torch.topk(change, k, sorted=False).indices] = True
        start = 0
        for n in names:
            size = global_state[n].numel()
            masks[n] = torch.nonzero(keep[start : start + size]).reshape(-1)
            start += size
    return masks


def fmnist_update(seed: int, data_dir: str | None, client: int) -> tuple[Update, int]:
    from flayer.data import load_dataset
    from flayer.partition import make_partition
    from flayer.train import client_data, sgd_epochs

    ds = load_dataset("fmnist", data_dir)
    part = make_partition(ds.y, ds.num_classes, 20, "dir0.1", seed)
    data = client_data(ds, part.clients[client])
    torch.manual_seed(seed)
    model = build_model(ds.model_spec())
    global_state = float_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.005)
    sgd_epochs(model, data.train, opt, 1, 10, torch.device("cpu"), torch.Generator().manual_seed(seed))
    local = float_state(model)
    masks = flayer_masks(local, global_state, model)
    return delta_update(local, global_state, masks, data.num_train), data.num_train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--skip-fmnist", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    resnet = state_numpy(float_state(build_model(ModelSpec("resnet18", in_channels=3, height=32, width=32))))
    shapes = {k: tuple(v.shape) for k, v in resnet.items()}
    rows = []
    for density in (0.01, 0.10, 0.50):
        update = random_update(shapes, density, rng)
        rows.append(measure(f"ResNet-18, random {density:.0%}", update, UpdateOptions(), args.repeats))
        if density == 0.10:
            for opts in (UpdateOptions("fp16"), UpdateOptions("int8"), UpdateOptions("int8", zstd=True)):
                rows.append(measure(f"ResNet-18, random {density:.0%}", update, opts, args.repeats))
    if not args.skip_fmnist:
        update, n_train = fmnist_update(args.seed, args.data_dir, args.client)
        label = f"FedAvgCNN FMNIST, FLAYER mask (client {args.client}, {n_train} samples)"
        rows.append(measure(label, update, UpdateOptions(), args.repeats))
        rows.append(measure(label, update, UpdateOptions(zstd_masks=False), args.repeats))
        rows.append(measure(label, update, UpdateOptions("int8", zstd=True), args.repeats))
        for name, d in update.deltas.items():
            print(f"  {name}: {d.count}/{d.numel} sent, positions {encode_best(d.indices, d.numel)[0].name}")
    head = [
        "update",
        "coords",
        "sent",
        "values",
        "pos bits / nH(p)",
        "pos bits / sent",
        "encoded",
        "vs dense fp32",
        "vs int32 idx + fp32",
        "encode MB/s",
        "decode MB/s",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
