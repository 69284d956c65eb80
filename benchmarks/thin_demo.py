"""The demo fleet with thin-link settings against today's defaults, on the real emulator.

Runs ``flayer emulate --config configs/emulate-demo.toml`` (20 devices, a real broker, synchronous
rounds) per seed twice: as configured (fp32 uploads, full model downloads) and with link-fitted uploads
with error feedback (``--upload fit --error-feedback``) and int8 delta downloads
(``--delta-downloads int8``). Tabulates, mean over seeds: the share of each profile's trained updates
that were accepted, MB down and up per round (every byte over the devices' emulated links), and the
personal models' final accuracy. Resumable (a run whose summary.json exists is not run again):

    python benchmarks/thin_demo.py --out docs/results/thin-demo
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
VARIANTS = {"today": [], "thin": ["--upload", "fit", "--error-feedback", "--delta-downloads", "int8"]}


def run(out: Path, variant: str, seed: int, rounds: int) -> dict[str, Any]:
    folder = out / f"{variant}-s{seed}"
    if not (folder / "summary.json").exists():
        cmd = [sys.executable, "-m", "cli.main", "emulate", "--config", str(CONFIG), *LR, "--seed", str(seed),
               "--rounds", str(rounds), "--out", str(folder), *VARIANTS[variant]]
        t0 = time.perf_counter()
        with open(out / f"{variant}-s{seed}.log", "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        if rc != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {out / f'{variant}-s{seed}.log'}")
        print(f"  {variant} seed {seed}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(x) for x in (folder / "rounds.jsonl").read_text().splitlines() if x.strip()]
    return {"summary": summary, "rounds": rows}


def table(results: dict[str, list[dict[str, Any]]], seeds: list[int], rounds: int) -> str:
    def mean(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.2f}" + (f" ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else "")

    lines = [f"Demo fleet (`configs/emulate-demo.toml`: 20 devices, FLAYER, Fashion-MNIST Dir(0.1), synchronous "
             f"rounds), {rounds} rounds, seeds {seeds}; `python benchmarks/thin_demo.py`.", "",
             "| | today (fp32, full downloads) | thin (fit + error feedback, int8 deltas) |", "|---|---|---|"]
    profiles = sorted({p["profile"] for rs in results.values() for r in rs for p in r["summary"]["profiles"]})
    for prof in profiles:
        cells = []
        for v in VARIANTS:
            acc = sum(p["accepted"] for r in results[v] for p in r["summary"]["profiles"] if p["profile"] == prof)
            tr = sum(p["trained"] for r in results[v] for p in r["summary"]["profiles"] if p["profile"] == prof)
            cells.append(f"{acc}/{tr} = {100 * acc / tr:.0f}%" if tr else "-")
        lines.append(f"| {prof}: updates accepted / trained | {cells[0]} | {cells[1]} |")
    for label, key in (("MB down per round", "mb_down"), ("MB up per round", "mb_up")):
        vals = {v: [statistics.mean(x[key] for x in r["rounds"]) for r in results[v]] for v in VARIANTS}
        lines.append(f"| {label} | {mean(vals['today'])} | {mean(vals['thin'])} |")
    down = {v: statistics.mean(statistics.mean(x["mb_down"] for x in r["rounds"]) for r in results[v])
            for v in VARIANTS}
    lines.append(f"| MB down, thin / today | 1 | {down['thin'] / down['today']:.2f} |")
    accs = {v: [100 * r["summary"]["final_acc"] for r in results[v]] for v in VARIANTS}
    lines.append(f"| personal models' final accuracy % | {mean(accs['today'])} | {mean(accs['thin'])} |")
    walls = {v: [r["summary"]["run_s"] for r in results[v]] for v in VARIANTS}
    lines.append(f"| wall seconds per run | {mean(walls['today'])} | {mean(walls['thin'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/thin-demo")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {v: [run(args.out, v, s, args.rounds) for s in seeds] for v in VARIANTS}
    text = table(results, seeds, args.rounds)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
