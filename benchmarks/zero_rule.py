"""What Algorithm 1 read literally (server rule ``zero``) does to the global model, round by round.

Runs FLAYER with rule ``zero`` and prints, per round, how many global coordinates no client sent
(the rule sets them to 0), how many of those no client changed at all during local training, and
each tensor's norm after aggregation relative to before.

    python benchmarks/zero_rule.py --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flayer.config import TrainConfig
from flayer.data import load_dataset
from flayer.partition import make_partition
from flayer.engine import initial_global_state
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.train import client_data
from flayer.update import float_state


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--samples", type=int, default=12000)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset(args.dataset)
    part = make_partition(ds.y, ds.num_classes, args.clients, "dir0.1", seed=args.seed, samples=args.samples)
    clients = [client_data(ds, c) for c in part.clients]
    strategy = make_strategy("flayer", ds.model_spec(), TrainConfig(device="cpu"), {"server_rule": "zero"})
    g = initial_global_state(strategy, args.seed)
    states = [strategy.initial_state() for _ in clients]
    for r in range(1, args.rounds + 1):
        agg = strategy.aggregator(g)
        moved = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in g.items()}
        for i, data in enumerate(clients):
            ctx = RoundContext(round=r, client=i, seed=args.seed)
            model = strategy.receive(g, states[i], data, ctx)
            result = strategy.local_round(model, g, states[i], data, ctx)  # trains ``model`` in place
            states[i] = result.state
            agg.fold(result.update)
            local = float_state(model)
            for k in g:
                moved[k] |= local[k] != g[k]
        new = agg.result()
        unsent = {k: torch.from_numpy(agg.coordinate_weight(k) == 0).reshape(g[k].shape) for k in g}
        total = sum(int(u.sum()) for u in unsent.values())
        still = sum(int((u & ~moved[k]).sum()) for k, u in unsent.items())
        print(f"round {r}: {total} of {sum(v.numel() for v in g.values())} coordinates unsent (set to 0), "
              f"{still} of them unchanged by every client")
        for k, u in unsent.items():
            print(f"  {k:16} unsent {int(u.sum()):7} / {u.numel():7}   norm after / before "
                  f"{float(new[k].norm() / g[k].norm()):.3f}")
        g = new
    return 0


if __name__ == "__main__":
    sys.exit(main())
