"""One FLAYER local round vs one plain-SGD local round: same FedAvgCNN, same client shard, same steps.

Both start from the same global model and train one local epoch on the same shard in the same order
(same seed); FLAYER adds the per-layer learning rates (Eq. 4, every step by default), the validation
accuracy A_l and the layer-wise masks (Eq. 5-9) with a sparse upload; plain SGD is FedAvg's local round
(dense upload). Runs alternate (A B, then B A) in one process. Target: the median of the per-pair
ratios FLAYER / SGD <= 1.10 (pairs cancel the drift of a shared machine's load; the ratios of the
medians and of the minima are printed too). The download step is timed apart: FLAYER's PLA plus
the head-only epoch vs FedAvg's plain load.

    python benchmarks/local_round.py                       # Fashion-MNIST, 20 clients, largest shard
    python benchmarks/local_round.py --dataset digits --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flayer.config import TrainConfig
from flayer.data import load_dataset
from flayer.partition import make_partition
from flayer.engine import initial_global_state
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext, Strategy
from flayer.train import client_data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--samples", type=int, default=12000)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--client", type=int, default=None, help="which shard (default: the largest)")
    p.add_argument("--repeats", type=int, default=11, help="timed pairs (>= 5)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--strategy", default="flayer", choices=("flayer", "flayer-ref"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a FLAYER option (TOML value)")
    args = p.parse_args()
    if args.repeats < 5:
        p.error("--repeats must be >= 5")
    torch.set_num_threads(args.threads)
    import tomllib

    options = {k: tomllib.loads(f"v = {v}")["v"] for k, _, v in (s.partition("=") for s in args.set)}
    ds = load_dataset(args.dataset)
    part = make_partition(ds.y, ds.num_classes, args.clients, "dir0.1", seed=0, samples=args.samples)
    cid = args.client if args.client is not None else max(range(part.num_clients),
                                                            key=lambda i: part.clients[i].train.size)
    data = client_data(ds, part.clients[cid])
    train = TrainConfig(device="cpu")
    spec = ds.model_spec("cnn")
    sgd = make_strategy("fedavg", spec, train)
    fl = make_strategy(args.strategy, spec, train, options)
    g = initial_global_state(sgd, 0)
    ctx = RoundContext(round=1, client=cid, seed=0)
    steps = -(-data.num_train // train.batch_size)

    def local(strategy: Strategy) -> float:
        model = strategy.model_from(g, ctx.device)
        t = time.perf_counter()
        strategy.local_round(model, g, strategy.initial_state(), data, ctx)
        return time.perf_counter() - t

    def download(strategy: Strategy) -> float:
        t = time.perf_counter()
        strategy.receive(g, strategy.initial_state(), data, ctx)
        return time.perf_counter() - t

    local(sgd), local(fl)  # warm-up
    t_sgd: list[float] = []
    t_fl: list[float] = []
    d_sgd: list[float] = []
    d_fl: list[float] = []
    for r in range(args.repeats):
        order = ((sgd, t_sgd), (fl, t_fl)) if r % 2 == 0 else ((fl, t_fl), (sgd, t_sgd))
        for strategy, times in order:
            times.append(local(strategy))
        d_sgd.append(download(sgd))
        d_fl.append(download(fl))
    ms = lambda xs: 1000 * statistics.median(xs)
    print(f"{args.dataset}, FedAvgCNN, client {cid}: {data.num_train} training samples, {steps} steps "
          f"of batch {train.batch_size}, {args.threads} thread(s), median of {args.repeats} alternated runs")
    print(f"{'':28}{'median ms':>10}{'min ms':>9}")
    print(f"{'plain SGD local round':28}{ms(t_sgd):10.1f}{1000 * min(t_sgd):9.1f}")
    print(f"{args.strategy + ' local round':28}{ms(t_fl):10.1f}{1000 * min(t_fl):9.1f}")
    ratio = statistics.median(t_fl) / statistics.median(t_sgd)
    pairwise = statistics.median(a / b for a, b in zip(t_fl, t_sgd))
    print(f"ratio {args.strategy} / SGD: median of the pairs {pairwise:.3f} (target <= 1.10: "
          f"{'met' if pairwise <= 1.10 else 'NOT met'}); ratio of the medians {ratio:.3f}, of the minima "
          f"{min(t_fl) / min(t_sgd):.3f}")
    med = statistics.median
    whole = (med(t_fl) + med(d_fl)) / (med(t_sgd) + med(d_sgd))
    print(f"download: FedAvg load {ms(d_sgd):.1f} ms; {args.strategy} PLA + head-only epoch "
          f"{ms(d_fl):.1f} ms (whole client round ratio {whole:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
