"""``flayer simulate`` at 1,000 devices: the current simulator against the earlier path, in one process,
alternating (A B, then B A). The earlier path, kept here: the download's model freshly built and randomly
initialised per call (``fresh_model_from``; now copied from a template built once,
:meth:`flayer.strategies.base.Strategy.blank_model`), and FLAYER's public positions drawn and selected per device
(``fresh_public_masks``; now once a round, :meth:`flayer.strategies.flayer.Flayer.public_masks`). Both arms run
over the same loaded data and the same ``flayer simulate`` arguments. Every run's results must be equal, bit
for bit (the summary without its timings, every round record without its seconds, the per-device accuracies):
the script exits 1 when they are not. Prints each pair's ratio old / new, their median, min and max, in wall
seconds and in this process's CPU seconds (the steadier figure on a shared machine)::

    python benchmarks/simulate_speed.py --repeats 2 --out runs/simulate-speed.json
    python benchmarks/simulate_speed.py --simulate "--dataset fmnist --partition-file \\
        docs/results/privacy-fmnist-1000/partition.npz --clients 1000 --rounds 2 --strategy flayer --threads 1 \\
        --dp central --dp-clip 0.3 --dp-noise 1.0401 --max-participations 3 --dp-seeded-noise"

A private run compares only with ``--dp-seeded-noise`` (its noise drawn from the seed; the CSPRNG's differs
from run to run by design).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flayer.masks import public_scores
from flayer.strategies.base import Strategy
from flayer.strategies.flayer import Flayer

DEFAULT = ("--dataset fmnist --partition-file docs/results/privacy-fmnist-1000/partition.npz --clients 1000 "
           "--join-ratio 0.2 --rounds 2 --seed 0 --strategy flayer --threads 1 --set flayer.positions=public")
TIMINGS = ("wall_seconds", "cpu_seconds")


def fresh_model_from(self: Strategy, state: Mapping[str, torch.Tensor], device: torch.device) -> nn.Module:
    """The earlier ``Strategy.model_from``: a new, randomly initialised model per call, then loaded."""
    model = self.new_model()
    missing = {k for k, v in model.state_dict().items() if v.is_floating_point()} - set(state)
    if missing:
        raise KeyError(f"state lacks tensors {sorted(missing)[:5]}")
    unexpected = model.load_state_dict(dict(state), strict=False).unexpected_keys
    if unexpected:
        raise KeyError(f"state holds tensors the model does not have: {sorted(unexpected)[:5]}")
    return model.to(device)


def fresh_public_masks(self: Flayer, change: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor | None]:
    """The earlier public positions: drawn and selected again by every device of the round."""
    return self._masks(public_scores(change, seed))


@contextlib.contextmanager
def old_path() -> Iterator[None]:
    current = Strategy.model_from, Flayer.public_masks
    Strategy.model_from = fresh_model_from  # type: ignore[method-assign]
    Flayer.public_masks = fresh_public_masks  # type: ignore[method-assign]
    try:
        yield
    finally:
        Strategy.model_from, Flayer.public_masks = current  # type: ignore[method-assign]


def results(folder: Path) -> dict[str, Any]:
    """What a run reports, its timings left out: summary.json and every metrics.jsonl record."""
    summary = {k: v for k, v in json.loads((folder / "summary.json").read_text()).items() if k not in TIMINGS}
    records = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        records.append({k: v for k, v in rec.items() if k not in ("time", "wall_s", "seconds")})
    return {"summary": summary, "records": records}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", default=DEFAULT, help="the flayer simulate flags (no --out)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (old, new), alternating which goes first")
    p.add_argument("--out", type=Path, default=None, help="also write the timings and the verdict as JSON here")
    a = p.parse_args()
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    from cli.common import load_data, run_config, set_threads
    from cli.main import build_parser
    from cli.simulate import run_simulation

    args = build_parser().parse_args(["simulate", *shlex.split(a.simulate)])
    cfg = run_config(args)
    set_threads(cfg)
    prepared = load_data(cfg)
    clip_only = None if args.clip_only is None else (args.clip_only, args.clip_average)
    times: dict[str, list[float]] = {"old": [], "new": []}
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    reference: dict[str, Any] | None = None
    equal = True
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for arm in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                out = Path(tmp) / f"{arm}-{rep}"
                out.mkdir()
                t0, c0 = time.perf_counter(), time.process_time()
                with old_path() if arm == "old" else contextlib.nullcontext():
                    run_simulation(cfg, prepared, out, quiet=True, seeded_noise=args.dp_seeded_noise,
                                   clip_only=clip_only)
                times[arm].append(time.perf_counter() - t0)
                cpu[arm].append(time.process_time() - c0)
                got = results(out)
                if reference is None:
                    reference = got
                elif got != reference:
                    equal = False
                    print(f"{arm} run {rep}: results differ from the first run's", file=sys.stderr)
                print(f"{arm} run {rep}: {times[arm][-1]:.1f} s wall, {cpu[arm][-1]:.1f} s CPU", file=sys.stderr)
    lines = []
    for what, t in (("wall", times), ("CPU", cpu)):
        ratios = [o / n for o, n in zip(t["old"], t["new"])]
        lines.append(f"{what}: old {statistics.median(t['old']):.1f} s, new {statistics.median(t['new']):.1f} s (medians); "
                     f"old / new per pair: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}, "
                     f"max {max(ratios):.2f} over {len(ratios)} pair(s)")
    lines.append(f"results {'equal' if equal else 'DIFFER'}")
    print("\n".join(lines))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"simulate": a.simulate, "wall": times, "cpu": cpu, "equal": equal,
                                     "summary": lines}, indent=1) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
