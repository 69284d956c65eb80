"""What privacy adds to a device's local round: a plain FLAYER round vs the same round private, side by side.

One client shard, the same global model and seed; runs alternate (plain, private, then private, plain) in
one process and the per-pair ratios private / plain are printed (median, and the ratio of the minima).
"private" is what a device runs in a private round: public positions (``positions = "public"``), the
clip to C and, with ``--mode local``, its Gaussian share on every value it sends
(:func:`flayer.engine.privacy.privatize`); with ``--secure`` also the secure round's device work after
training: laying the upload out on the common positions, quantising it into the ring and masking it
with its neighbours' pairwise masks (``--neighbours`` of them; key agreement included).

    python benchmarks/dp_cost.py                      # Fashion-MNIST, 20 clients, the largest shard
    python benchmarks/dp_cost.py --mode local --secure --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flayer.config import TrainConfig
from flayer.data import load_dataset
from flayer.engine import client_round, initial_global_state
from flayer.engine.privacy import PrivacySettings, RoundPrivacy
from flayer.partition import make_partition
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.train import client_data


def masking_seconds(update, neighbours: int) -> float:  # type: ignore[no-untyped-def]
    """The device's secure-round work after training, run through the real protocol code in process."""
    from flayer.engine.secure import device_vector, round_params
    from flayer.engine.secure_layout import layout_of
    from flayer.secagg import SecAggClient, SecAggServer

    ids = tuple(f"d{i:03d}" for i in range(neighbours + 1))
    lay = layout_of(update)
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "bench", 1, ids, lay, 0)
    clients = {d: SecAggClient(params, d) for d in ids}
    server = SecAggServer(params)
    for c in clients.values():
        server.receive_advert(c.advertise())
    for d, c in clients.items():
        server.receive_shares(c.share_keys(server.key_bundle(d)))
    shares = server.shares_for(ids[0])
    t0 = time.perf_counter()
    vector = device_vector(update, lay, params, np.random.default_rng(0))
    clients[ids[0]].masked_input(shares, vector)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--samples", type=int, default=12000)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7, help="timed pairs (>= 3)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mode", choices=("central", "local"), default="central")
    p.add_argument("--secure", action="store_true", help="add the secure round's masking")
    p.add_argument("--neighbours", type=int, default=34, help="k for --secure (34: the rule's k for 100 devices)")
    a = p.parse_args()
    if a.repeats < 3:
        p.error("--repeats must be >= 3")
    torch.set_num_threads(a.threads)
    data = load_dataset(a.dataset)
    part = make_partition(data.y, data.num_classes, a.clients, "dir0.1", seed=0, samples=a.samples)
    idx = max(range(a.clients), key=lambda i: len(part.clients[i].train))
    client = client_data(data, part.clients[idx])
    train = TrainConfig(lr=0.05, batch_size=10)
    plain = make_strategy("flayer", data.model_spec(), train)
    private = make_strategy("flayer", data.model_spec(), train, {"positions": "public"})
    rp = RoundPrivacy.of(PrivacySettings(enabled=True, mode=a.mode, clip=1.0, noise_multiplier=1.0)
                         .resolve(100, 20))
    g = initial_global_state(plain, 0)
    ctx = RoundContext(round=1, client=idx, seed=0)

    def run(private_round: bool) -> float:
        t0 = time.perf_counter()
        _, res = client_round(private if private_round else plain, g, plain.initial_state(), client, ctx,
                              privacy=rp if private_round else None, noise_rng=np.random.default_rng(1))
        elapsed = time.perf_counter() - t0
        if private_round and a.secure and res is not None:  # only the device's own masking is timed
            elapsed += masking_seconds(res.update, a.neighbours)
        return elapsed

    run(False), run(True)  # warm-up
    pairs = []
    for i in range(a.repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        t = {k: run(k) for k in order}
        pairs.append((t[False], t[True]))
    ratios = [b / a_ for a_, b in pairs]
    plain_s, priv_s = [x for x, _ in pairs], [y for _, y in pairs]
    what = f"private ({a.mode} noise{', secure masking, k = ' + str(a.neighbours) if a.secure else ''})"
    print(f"client {idx} ({len(client.train)} training images), {a.repeats} pairs, {a.threads} thread(s)")
    print(f"plain FLAYER round: median {statistics.median(plain_s):.3f} s, min {min(plain_s):.3f} s")
    print(f"{what}: median {statistics.median(priv_s):.3f} s, min {min(priv_s):.3f} s")
    print(f"ratio private / plain: median of pairs {statistics.median(ratios):.3f}, of minima "
          f"{min(priv_s) / min(plain_s):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
