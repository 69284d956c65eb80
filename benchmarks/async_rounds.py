"""Synchronous against asynchronous buffered rounds on the demo fleet, on the same simulated-time budget.

Runs ``flayer emulate --config configs/emulate-demo.toml --virtual`` for each mode and seed (the fleet's
profiles and availability timelines, the real local rounds, simulated time; a fixed compute cost per
sample so runs repeat exactly), skipping runs that finished with the same settings (resumable: each run
folder records its command and a digest of the config files in ``bench-settings.json``), then writes the
comparison -- per profile the share of trained updates accepted, time to a target accuracy, final
personal-model accuracy, mean ± std over seeds -- as Markdown and a plot into the output folder:

    python benchmarks/async_rounds.py --out docs/results/async-demo

``--emulator`` also runs the real emulator (broker, coordinator, 20 device clients) once per mode for
seed 0 and puts its accepted shares per profile beside the simulated ones (minutes per run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs/emulate-demo.toml"
# the learning rate the published results were measured at (the demo config had it before the tuning
# raised the config's default to FLAYER's tuned 0.05): kept, so that the recorded tables reproduce
LR = ["--lr", "0.005"]
# and the links they were measured with (fp32 uploads as planned, full downloads), named so the tables do
# not change when the shipped config turns the thin-link settings on (--virtual honours them)
PLAIN = ["--upload", "plan", "--no-error-feedback", "--delta-downloads", "off", "--value-codec", "fp32"]
MODES = {"sync": [], "async": ["--mode", "async", "--buffer", "8", "--max-staleness", "32", "--concurrency", "11"]}


SETTINGS_FILE = "bench-settings.json"  # in each run folder: the command (and config digest) it was made with


def _key(cmd: list[str]) -> dict[str, Any]:
    """Everything that changes a run's result: its arguments (the output folder left out) and the bytes
    of the config and profiles files it reads."""
    import hashlib

    args = cmd[3:]
    if "--out" in args:
        i = args.index("--out")
        args = args[:i] + args[i + 2:]
    h = hashlib.sha256()
    for f in (CONFIG, CONFIG.parent / "profiles.toml"):
        h.update(f.read_bytes() if f.exists() else b"")
    return {"args": args, "config_sha256": h.hexdigest()}


def done(folder: Path, cmd: list[str]) -> bool:
    """The run in ``folder`` finished with exactly these settings (reused, not run again)."""
    try:
        return (folder / "summary.json").exists() and json.loads((folder / SETTINGS_FILE).read_text()) == _key(cmd)
    except (FileNotFoundError, ValueError):
        return False


def run(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` (its ``--out`` folder), unless that folder holds a finished run of the same settings."""
    folder = Path(cmd[cmd.index("--out") + 1])
    if done(folder, cmd):
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    (folder / SETTINGS_FILE).write_text(json.dumps(_key(cmd), indent=1) + "\n")
    print(f"  done in {time.perf_counter() - t0:.0f}s: {' '.join(cmd[3:])}", file=sys.stderr)


def virtual(out: Path, mode: str, seed: int, budget: float, cost: float) -> dict[str, Any]:
    folder = out / f"virtual-{mode}-s{seed}"
    run([sys.executable, "-m", "cli.main", "emulate", "--config", str(CONFIG), *LR, *PLAIN, "--virtual",
         "--seed", str(seed), "--rounds", "100000", "--budget", str(budget), "--sample-cost", str(cost),
         "--out", str(folder), *MODES[mode]], out / f"virtual-{mode}-s{seed}.log")
    return json.loads((folder / "summary.json").read_text())


def emulated(out: Path, mode: str, rounds: int, cost: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The real emulator and the simulated clock on the same number of model versions, seed 0."""
    folder = out / f"emulator-{mode}-r{rounds}"
    run([sys.executable, "-m", "cli.main", "emulate", "--config", str(CONFIG), *LR, *PLAIN, "--seed", "0",
         "--rounds", str(rounds), "--out", str(folder), *MODES[mode]], out / f"emulator-{mode}-r{rounds}.log")
    sim = out / f"virtual-{mode}-r{rounds}"
    run([sys.executable, "-m", "cli.main", "emulate", "--config", str(CONFIG), *LR, *PLAIN, "--virtual",
         "--seed", "0", "--rounds", str(rounds), "--sample-cost", str(cost), "--out", str(sim), *MODES[mode]],
        out / f"virtual-{mode}-r{rounds}.log")
    return json.loads((folder / "summary.json").read_text()), json.loads((sim / "summary.json").read_text())


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{100 * statistics.mean(xs):.2f} ± {100 * statistics.stdev(xs):.2f}" if len(xs) > 1 \
        else f"{100 * xs[0]:.2f}"


def report(out: Path, runs: dict[str, list[dict[str, Any]]], budget: float, target: float,
           emu: dict[str, dict[str, Any]]) -> str:
    lines = [f"Demo fleet (`configs/emulate-demo.toml`: 20 devices, FLAYER, Fashion-MNIST Dir(0.1)), "
             f"{budget:g} simulated seconds per run, seeds {sorted(r['seed'] for r in runs['sync'])}.", "",
             "| | sync | async |", "|---|---|---|"]
    profiles = sorted({p for rs in runs.values() for r in rs for p in r["profiles"]})
    for p in profiles:
        cells = []
        for mode in ("sync", "async"):
            acc = sum(r["profiles"].get(p, {}).get("accepted", 0) for r in runs[mode])
            done = sum(r["profiles"].get(p, {}).get("trained", 0) - r["profiles"].get(p, {}).get("in_flight", 0)
                       for r in runs[mode])
            cells.append(f"{acc}/{done} = {100 * acc / done:.0f}%" if done else "-")
        lines.append(f"| {p}: updates accepted / trained | {cells[0]} | {cells[1]} |")
    for mode_label, key in (("model versions", "versions"),):
        lines.append(f"| {mode_label} | " + " | ".join(
            f"{statistics.mean(r[key] for r in runs[m]):.1f}" for m in ("sync", "async")) + " |")
    sync_last = statistics.mean(r["acc"][-1] for r in runs["sync"] if r["acc"])
    for goal, label in ((target, f"{100 * target:.0f}% global acc"),
                        (sync_last, f"sync's mean last accuracy ({100 * sync_last:.2f}%)")):
        ttt = {m: [next((t for t, a in zip(r["t"], r["acc"]) if a >= goal), None) for r in runs[m]] for m in runs}
        lines.append(f"| simulated s to {label} (runs that reached it) | " + " | ".join(
            (f"{statistics.mean(x for x in ttt[m] if x is not None):.0f} ({sum(x is not None for x in ttt[m])}/"
             f"{len(ttt[m])})" if any(x is not None for x in ttt[m]) else f"not reached (0/{len(ttt[m])})")
            for m in ("sync", "async")) + " |")
    lines.append("| last global accuracy % | " + " | ".join(
        mean_std([r["acc"][-1] for r in runs[m] if r["acc"]]) for m in ("sync", "async")) + " |")
    lines.append("| final personal-model accuracy % | " + " | ".join(
        mean_std([r["final_personal_acc"] for r in runs[m]]) for m in ("sync", "async")) + " |")
    lines.append("| CPU seconds per run | " + " | ".join(
        f"{statistics.mean(r['cpu_s'] for r in runs[m]):.0f}" for m in ("sync", "async")) + " |")
    if emu:
        lines += ["", "The real emulator (broker, coordinator, 20 device clients; seed 0) against the simulated "
                  "clock on the same number of model versions:", "",
                  "| mode | versions | profile | emulator: accepted / trained | simulated: accepted / trained |",
                  "|---|---|---|---|---|"]
        for mode, (summ, sim) in emu.items():
            for row in summ.get("profiles", []):
                s_ = sim["profiles"].get(row["profile"], {})
                lines.append(f"| {mode} | {sim['versions']} | {row['profile']} | {row['accepted']}/{row['trained']} "
                             f"| {s_.get('accepted', 0)}/{s_.get('trained', 0)} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, runs: dict[str, list[dict[str, Any]]]) -> None:
    sys.path.insert(0, str(ROOT))
    from cli.plots import _pyplot

    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for mode, style in (("sync", "-"), ("async", "--")):
        for r in runs[mode]:
            ax.plot(r["t"], r["acc"], style, label=f"{mode}, seed {r['seed']}", linewidth=1.4)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("global model test accuracy (all clients)")
    ax.set_title("demo fleet: synchronous vs asynchronous buffered rounds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/async-demo")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget", type=float, default=90.0, help="simulated seconds per run")
    p.add_argument("--sample-cost", type=float, default=0.0005, help="compute seconds per sample at slowdown 1")
    p.add_argument("--target", type=float, default=0.80, help="global accuracy whose time is reported")
    p.add_argument("--emulator", action="store_true",
                   help="also run the real emulator (seed 0) and the simulated clock on the same versions")
    p.add_argument("--emulator-rounds", default="sync=10,async=30", metavar="sync=R,async=R")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    c0 = time.perf_counter()
    runs = {m: [virtual(args.out, m, s, args.budget, args.sample_cost) for s in seeds] for m in MODES}
    versions = {k: int(v) for k, v in (x.split("=") for x in args.emulator_rounds.split(","))}
    emu = {m: emulated(args.out, m, versions[m], args.sample_cost) for m in MODES} if args.emulator else {}
    text = report(args.out, runs, args.budget, args.target, emu)
    (args.out / "comparison.md").write_text(text)
    plot(args.out / "accuracy.png", runs)
    print(text)
    print(f"({time.perf_counter() - c0:.0f}s; outputs in {args.out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
