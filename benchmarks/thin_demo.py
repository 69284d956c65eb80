"""The demo fleet with thin-link settings against today's defaults, on the real emulator.

Runs ``flayer emulate --config configs/emulate-demo.toml`` (20 devices, a real broker, synchronous
rounds) per seed twice: with the plain settings (fp32 uploads as planned, no error feedback, full model
downloads, each named on the command line) and with link-fitted uploads
with error feedback (``--upload fit --error-feedback``) and int8 delta downloads
(``--delta-downloads int8``). Tabulates, mean over seeds: the share of each profile's trained updates
that were accepted, MB down and up per round (every byte over the devices' emulated links), and the
personal models' final accuracy. Resumable (a run whose summary.json exists is not run again):

    python benchmarks/thin_demo.py --out docs/results/thin-demo
"""

from __future__ import annotations

import argparse
import hashlib
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
# each variant names every thin-link setting, so the table does not change when the shipped config does
PLAIN = ["--upload", "plan", "--no-error-feedback", "--delta-downloads", "off", "--value-codec", "fp32"]
FIELD = ["--upload", "fit", "--error-feedback", "--delta-downloads", "int8"]
VARIANTS = {"today": PLAIN, "thin": FIELD}


CODE = ("cli", "coordinator", "edge_client", "emulator", "flayer", "mqtt_broker", "protocol", "transport")


def settings_key(cmd: list[str], files: list[Path]) -> str:
    """A digest of everything that changes a run's result: its command line (flags, seed, rounds), the
    bytes of the config files it reads and of the code that runs it (every ``.py`` file of the packages);
    runs are reused only under the same key, so a run made by other code is made again."""
    h = hashlib.sha256("\0".join(cmd).encode())
    for f in [*files, *sorted(p for d in CODE for p in (ROOT / d).rglob("*.py"))]:
        h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def emulate(out: Path, name: str, flags: list[str], seed: int, rounds: int,
            config: Path = CONFIG) -> dict[str, Any]:
    """One ``flayer emulate`` run of ``config`` with ``flags`` (its folder keyed by every setting,
    resumable: a finished run with the same key is read, not run again); its summary, rounds and devices."""
    args = ["emulate", "--config", str(config.relative_to(ROOT)), "--seed", str(seed), "--rounds", str(rounds),
            *flags]
    profiles = config.parent / "profiles.toml"
    key = settings_key(args, [config, *([profiles] if profiles.exists() else [])])
    folder = out / f"{name}-s{seed}-{key}"
    if not (folder / "summary.json").exists():
        cmd = [sys.executable, "-m", "cli.main", *args, "--out", str(folder)]
        t0 = time.perf_counter()
        log_file = out / f"{name}-s{seed}-{key}.log"
        with open(log_file, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        if rc != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log_file}")
        print(f"  {name} seed {seed}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    if not (folder / "settings.json").exists():  # the command that made it, beside its outputs
        (folder / "settings.json").write_text(json.dumps({"command": ["flayer", *args], "key": key}, indent=1))
    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(x) for x in (folder / "rounds.jsonl").read_text().splitlines() if x.strip()]
    devices = [json.loads(x) for x in (folder / "devices.jsonl").read_text().splitlines() if x.strip()]
    return {"summary": summary, "rounds": rows, "devices": devices, "folder": folder}


def run(out: Path, variant: str, seed: int, rounds: int) -> dict[str, Any]:
    return emulate(out, variant, [*LR, *VARIANTS[variant]], seed, rounds)


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
