"""Secure aggregation on emulated fleets over Mosquitto, side by side with plain rounds: the same fleet run
twice by ``flayer emulate`` (FLAYER, the given profile mix), once plain at the round's public positions
and once with ``--secure-agg``, at each fleet size.

Per run it reads the coordinator's round records (``coordinator/metrics.jsonl``: rounds closed, rounds
unmasked or abandoned, devices dropped out of a round's protocol), the emulator's (``rounds.jsonl``: wall
seconds, MB up and down counted on the devices' sockets, every protocol message included), and from
``/proc/<pid>/stat`` every 0.25 s the CPU seconds of the coordinator process and of the worker processes
that host the devices (per update trained: the devices' CPU, training included, so the difference between
the two runs is what the protocol adds on the devices).

    nice -n 10 python benchmarks/secagg_fleet.py --devices 100,1000 --rounds 3 --out runs/bench-secagg-fleet

A run whose ``measure.json`` is under ``--out`` (``<devices>-<plain|secure>``) is not run again (delete it
to re-measure), so an interrupted benchmark resumes. Plain rounds run with ``--set flayer.positions=public`` so that
both runs send the same positions (secure rounds need common ones); the emulator chooses the secure
rounds' design dropout rate from the profiles (docs/explanation/secure-aggregation.md), unless ``--secure-dropout``
sets it (a mix whose profiles predict more than a cohort can be designed for is refused by the coordinator).
``--order secure,plain`` runs the secure one first; ``--upload fit`` fits both runs' uploads to the devices' links.
The "dropped" column is the selected devices whose masked input is not in the round's sum.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from http_models import Sampler, _cpu_s, run_emulate


class CpuSampler(Sampler):
    """The CPU seconds of the coordinator and of the workers, every ``period`` seconds."""

    def __init__(self, period: float = 0.25) -> None:
        self.coordinator: int | None = None
        self.workers: list[int] = []
        self.last: dict[int, float] = {}
        self.cpu: list[tuple[float, float, float]] = []  # (t, coordinator s, workers s)
        super().__init__(period)

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            for pid in [p for p in [self.coordinator, *self.workers] if p is not None]:
                c = _cpu_s(pid)
                if c is not None:
                    self.last[pid] = c
            if self.coordinator is not None:
                self.cpu.append((time.time(), self.last.get(self.coordinator, 0.0),
                                 sum(self.last.get(p, 0.0) for p in self.workers)))

    def at(self, t: float) -> tuple[float, float, float]:  # type: ignore[override]
        before = [s for s in self.cpu if s[0] <= t]
        return before[-1] if before else (t, 0.0, 0.0)


def run_one(args: argparse.Namespace, devices: int, secure: bool, out: Path) -> dict[str, Any]:
    done = out / "measure.json"
    if done.exists():
        return json.loads(done.read_text())
    # at most half the fleet per round: with the profiles' churn a fleet is never all online at once
    selected = min(args.selected, devices // 2)
    quorum = max(1, math.floor(selected / args.over_selection))
    cmd = [sys.executable, "-m", "cli.main", "emulate", "--dataset", args.dataset, "--clients", str(devices),
           "--rounds", str(args.rounds), "--strategy", "flayer", "--seed", "0", "--partition", "iid",
           "--samples", str(args.samples), "--quorum", str(quorum), "--over-selection", str(args.over_selection),
           "--min-devices", str(selected), "--deadline", str(args.deadline),
           "--broker-kind", "mosquitto", "--timeout", str(args.timeout), "--out", str(out)]
    if args.mix:
        cmd += ["--mix", args.mix]
    if args.upload:
        cmd += ["--upload", args.upload]
    if secure and args.secure_dropout is not None:
        cmd += ["--secure-dropout", str(args.secure_dropout)]
    cmd += ["--secure-agg"] if secure else ["--set", "flayer.positions=public"]
    sampler = CpuSampler()
    t0 = time.time()

    def watch(line: str) -> None:
        if m := re.search(r"coordinator pid (\d+), worker pids ([\d, ]+)", line):
            sampler.coordinator = int(m.group(1))
            sampler.workers = [int(p) for p in m.group(2).split(",")]

    text = run_emulate(cmd, out, watch, sampler.stop)
    coord = {r["round"]: r for r in map(json.loads, (out / "coordinator/metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "round"}
    emu = {r["round"]: r for r in map(json.loads, (out / "rounds.jsonl").read_text().splitlines())}
    rounds = []
    for r in sorted(coord):
        c, e = coord[r], emu[r]
        a, b = sampler.at(c["time"] - e["wall_s"]), sampler.at(c["time"])
        rounds.append({"round": r, "wall_s": e["wall_s"], "selected": e["selected"], "reported": e["reported"],
                       "accepted": c.get("accepted"), "mb_up": e["mb_up"], "mb_down": e["mb_down"],
                       "secure": "secure_survivors" in c, "abandoned": c.get("secure_abandoned"),
                       "survivors": len(c.get("secure_survivors") or []),
                       "dropped": len(c.get("secure_dropped") or []),
                       "coordinator_cpu_s": round(b[1] - a[1], 3), "workers_cpu_s": round(b[2] - a[2], 3),
                       "acc": c.get("acc")})
    chosen = re.search(r"dropout rate of ([\d.]+)", text)
    result = {"devices": devices, "secure": secure, "rounds": rounds, "run_s": round(time.time() - t0, 1),
              "secure_dropout": float(chosen.group(1)) if chosen else (args.secure_dropout if secure else None),
              "command": " ".join(cmd[1:])}
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _mean(rows: list[dict[str, Any]], f: Any) -> float:
    vals = [f(r) for r in rows]
    return sum(vals) / len(vals) if vals else float("nan")


def summary(r: dict[str, Any]) -> dict[str, float]:
    rows = r["rounds"]
    return {"closed": len(rows), "unmasked": sum(1 for x in rows if x["secure"] and not x["abandoned"]),
            "dropped": _mean(rows, lambda x: x["dropped"]),
            "dropped_share": _mean(rows, lambda x: x["dropped"] / max(x["selected"], 1)),
            "mb_up_dev": _mean(rows, lambda x: x["mb_up"] / max(x["selected"], 1)),
            "mb_down_dev": _mean(rows, lambda x: x["mb_down"] / max(x["selected"], 1)),
            "workers_cpu_s": _mean(rows, lambda x: x["workers_cpu_s"]),
            "wall_s": _mean(rows, lambda x: x["wall_s"]),
            "coord_cpu_s": _mean(rows, lambda x: x["coordinator_cpu_s"]),
            "dev_cpu_s": _mean(rows, lambda x: x["workers_cpu_s"] / max(x["reported"], 1)),
            "acc": rows[-1]["acc"] if rows else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="100,1000", help="fleet sizes, comma separated (100,1000)")
    p.add_argument("--selected", type=int, default=100,
                   help="devices online before a round opens and asked per round, at most half the fleet (100)")
    p.add_argument("--over-selection", type=float, default=1.3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--samples", type=int, default=20000, help="samples of the data set shared by the fleet")
    p.add_argument("--mix", default="", help="device profiles (default: the built-in mix)")
    p.add_argument("--upload", choices=["plan", "fit"], default=None,
                   help="the devices' [edge] upload in both runs (default: the emulator's); fit: fitted to each uplink")
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--secure-dropout", type=float, default=None,
                   help="the secure rounds' design dropout ([privacy] secure_dropout; default: the emulator's, from the "
                        "profiles' chance of going off within the deadline)")
    p.add_argument("--order", default="plain,secure",
                   help="which runs, in which order: plain,secure (default) or secure,plain")
    p.add_argument("--out", default="runs/bench-secagg-fleet")
    args = p.parse_args()
    order = [x.strip() for x in args.order.split(",")]
    if sorted(order) != ["plain", "secure"]:
        p.error(f"--order: give plain and secure once each, comma separated; got {args.order!r}")
    if args.secure_dropout is not None and not 0 <= args.secure_dropout < 0.5:
        p.error(f"--secure-dropout: a rate in [0, 0.5), got {args.secure_dropout}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = [run_one(args, n, secure, out / f"{n}-{'secure' if secure else 'plain'}")
               for n in (int(x) for x in args.devices.split(",")) for secure in (o == "secure" for o in order)]
    print(f"per round, mean over {args.rounds} rounds (FLAYER, {args.dataset}, public positions in both)")
    print(f"{'devices':>7} {'rounds':>7} {'closed':>6} {'unmasked':>8} {'dropped':>7} {'MB up/dev':>9} "
          f"{'MB down/dev':>11} {'round s':>8} {'coord CPU s':>11} {'workers CPU s':>13} {'dev CPU s/upd':>13} "
          f"{'last acc':>8}")
    sums = {(r["devices"], r["secure"]): summary(r) for r in results}
    for r in results:
        s = sums[(r["devices"], r["secure"])]
        print(f"{r['devices']:>7} {'secure' if r['secure'] else 'plain':>7} {s['closed']:>6} "
              f"{s['unmasked'] if r['secure'] else '-':>8} {s['dropped']:>7.1f} {s['mb_up_dev']:>9.3f} "
              f"{s['mb_down_dev']:>11.3f} {s['wall_s']:>8.1f} {s['coord_cpu_s']:>11.2f} {s['workers_cpu_s']:>13.2f} "
              f"{s['dev_cpu_s']:>13.3f} {s['acc']:>8.4f}"
              + (f"  (dropped {100 * s['dropped_share']:.1f}% of the selected"
                 + (f", secure_dropout {r['secure_dropout']:g})" if r.get("secure_dropout") is not None else ")")
                 if r["secure"] else ""))
    for n in sorted({r["devices"] for r in results}):
        if (n, True) in sums and (n, False) in sums:
            s, b = sums[(n, True)], sums[(n, False)]
            print(f"{n:>7} secure/plain, side by side: MB up per device x{s['mb_up_dev'] / b['mb_up_dev']:.3f}, MB down "
                  f"per device x{s['mb_down_dev'] / b['mb_down_dev']:.3f}, round time x{s['wall_s'] / b['wall_s']:.3f}, "
                  f"coordinator CPU a round x{s['coord_cpu_s'] / max(b['coord_cpu_s'], 1e-9):.3f}, device workers' CPU "
                  f"a round x{s['workers_cpu_s'] / max(b['workers_cpu_s'], 1e-9):.3f}, per update "
                  f"x{s['dev_cpu_s'] / max(b['dev_cpu_s'], 1e-9):.3f}")
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
