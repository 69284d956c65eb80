"""What one bench run costs per method: CPU seconds of a short simulation, side by side, and the
projected time of a full ``flayer bench`` at a chosen round count.

Each method runs ``--probe-rounds`` rounds (default 4, so FedALA's start phase and FedBABU's final
fine-tune are included) on one thread; the fixed part (calibration, start phase, fine-tune) is
separated from the per-round part by also running 2 rounds. Process CPU time is reported, so the
numbers hold on a busy machine too (one thread per run: CPU time ~ wall time on a free core).

    python benchmarks/baselines_cost.py --samples 12000 --rounds 50 --seeds 3 --jobs 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flayer.config import TrainConfig
from flayer.data import load_dataset
from flayer.partition import make_partition
from flayer.simulation import simulate
from flayer.strategies import STRATEGIES, make_strategy
from flayer.train import client_data


def cpu_of(method: str, spec, clients, rounds: int) -> float:  # type: ignore[no-untyped-def]
    strategy = make_strategy(method, spec, TrainConfig(device="cpu"))
    c0 = time.process_time()
    simulate(strategy, clients, rounds, seed=0)
    return time.process_time() - c0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--samples", type=int, default=12000)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--partition", default="dir0.1")
    p.add_argument("--probe-rounds", type=int, default=4)
    p.add_argument("--rounds", type=int, default=50, help="round count to project a bench for")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--methods", default=",".join(STRATEGIES))
    p.add_argument("--extra-methods", type=int, default=2,
                   help="methods not in this build to budget for, each at the mean per-round cost (e.g. flayer, "
                        "flayer-ref)")
    a = p.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset(a.dataset)
    part = make_partition(ds.y, ds.num_classes, a.clients, a.partition, 0, samples=a.samples, batch_size=10)
    clients = [client_data(ds, c) for c in part.clients]
    spec = ds.model_spec()
    print(f"{a.dataset} {a.partition}, {a.clients} clients, {a.samples} samples "
          f"({sum(c.num_train for c in clients)} train, {sum(len(c.test) for c in clients)} test), 1 thread")
    print(f"{'method':10s} {'CPU s/round':>11s} {'fixed CPU s':>11s} {'vs fedavg':>9s} {f'run @{a.rounds}r':>10s}")
    per_round, fixed = {}, {}
    for m in a.methods.split(","):
        short, long = cpu_of(m, spec, clients, 2), cpu_of(m, spec, clients, a.probe_rounds)
        per_round[m] = max(0.0, (long - short) / (a.probe_rounds - 2))
        fixed[m] = max(0.0, short - 2 * per_round[m])
    base = per_round.get("fedavg") or next(iter(per_round.values()))
    total = 0.0
    for m, pr in per_round.items():
        run = fixed[m] + a.rounds * pr
        total += run
        print(f"{m:10s} {pr:11.2f} {fixed[m]:11.1f} {pr / base:9.2f} {run:10.0f}")
    mean_round = sum(per_round.values()) / len(per_round)
    total += a.extra_methods * (a.rounds * 1.5 * mean_round)
    print(f"\nprojected bench: {len(per_round)} methods + {a.extra_methods} budgeted at 1.5x the mean per-round cost, "
          f"{a.seeds} seeds, {a.rounds} rounds, {a.jobs} parallel jobs: "
          f"{total * a.seeds / a.jobs / 60:.0f} min (CPU time / jobs; add ~5 s start-up per run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
