"""The field sensors' updates in ``make demo``, run after run: accepted / trained, downloads, round length.

Runs the shipped demo (``flayer emulate --config configs/emulate-demo.toml``: 20 devices, 4 of them
``flaky-field`` on a 1 Mbit/s uplink) over five seeds plus three more runs of seed 0 (a newcomer's
single run should land inside their spread), synchronous as shipped and with ``--mode async`` alone.
Per run: the ``flaky-field`` devices' updates accepted / trained, MB downloaded per round per selected
device as a share of the dense model, the rounds' mean length, the personal models' final accuracy per
profile, and the machine's load average when the run ended. Resumable: each run's folder is keyed by
its command, the config files and the code (:func:`thin_demo.settings_key`); a finished run is read, not
run again, so an interrupted measurement picks up where it stopped::

    python benchmarks/field_updates.py --out docs/results/field-updates

``--tabulate``: run nothing; tabulate the newest finished run of each planned (mode, seed, run) in
``--out``, whatever code made it (each folder's ``settings.json`` names its command and key).
``--baseline DIR``: also tabulate earlier runs of the same demo (folders holding ``rounds.jsonl``) as
the round length to compare against.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from thin_demo import ROOT, emulate

DENSE_MB = 2.328104  # the demo CNN (flayer.registry, "cnn" on 1x28x28): 582,026 fp32 parameters, in MB (10^6 bytes)
MODES = {"sync": [], "async": ["--mode", "async"]}
PROFILE = "flaky-field"


def plan(seeds: list[int], repeats: int, modes: list[str]) -> list[tuple[str, int, int]]:
    """(mode, seed, repeat) in the order run: seed 0 of every mode first, so a cut-short measurement
    still holds both modes."""
    order = [(m, seeds[0], 0) for m in modes]
    order += [(m, s, 0) for s in seeds[1:] for m in modes]
    order += [(m, seeds[0], r) for r in range(1, repeats + 1) for m in modes]
    return order


def finished_run(folder: Path) -> dict[str, Any]:
    """A finished run's summary, rounds and devices, as :func:`thin_demo.emulate` returns them."""
    def lines(name: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (folder / name).read_text().splitlines() if x.strip()]

    return {"summary": json.loads((folder / "summary.json").read_text()), "rounds": lines("rounds.jsonl"),
            "devices": lines("devices.jsonl"), "folder": folder}


def row(run: dict[str, Any]) -> dict[str, Any]:
    prof = {p["profile"]: p for p in run["summary"]["profiles"]}
    field = prof.get(PROFILE, {"trained": 0, "accepted": 0})
    rounds = run["rounds"]
    down = [r["mb_down"] / max(1, r["selected"]) / DENSE_MB for r in rounds]
    return {"field_accepted": field["accepted"], "field_trained": field["trained"],
            "field_share": field["accepted"] / field["trained"] if field["trained"] else float("nan"),
            "down_per_selected": statistics.mean(down) if down else float("nan"),
            "round_s": statistics.mean(r["wall_s"] for r in rounds) if rounds else float("nan"),
            "rounds": len(rounds), "run_s": run["summary"]["run_s"],
            "acc": {p: v.get("mean_final_acc") for p, v in sorted(prof.items())}}


def _ms(xs: list[float], digits: int = 2) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.{digits}f}" + (f" ± {statistics.stdev(xs):.{digits}f}" if len(xs) > 1 else "")


def table(rows: list[dict[str, Any]], baseline: list[float]) -> str:
    head = ("| mode | seed | run | flaky-field accepted / trained | MB down per selected device / dense model "
            "| mean round s | personal acc % (field, jetson, laptop, phone) | load (1, 5, 15 min) |")
    lines = [head, "|---" * 8 + "|"]
    for r in rows:
        acc = ", ".join(f"{100 * v:.1f}" if v is not None else "-" for v in r["acc"].values())
        lines.append(f"| {r['mode']} | {r['seed']} | {r['repeat']} | {r['field_accepted']}/{r['field_trained']} = "
                     f"{100 * r['field_share']:.0f}% | {r['down_per_selected']:.3f} | {r['round_s']:.1f} | {acc} "
                     f"| {r.get('load', '-')} |")
    lines.append("")
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        shares = [100 * r["field_share"] for r in rs]
        lines.append(f"- **{mode}**, {len(rs)} runs: flaky-field updates accepted {_ms(shares, 1)}% "
                     f"(lowest {min(shares):.0f}%); MB down per selected device "
                     f"{_ms([r['down_per_selected'] for r in rs], 3)} of the dense model; round "
                     f"{_ms([r['round_s'] for r in rs], 1)} s")
    if baseline:
        lines.append(f"- **baseline** (earlier code, {len(baseline)} runs): round {_ms(baseline, 1)} s")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/field-updates")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--repeats", type=int, default=3, help="more runs of the first seed")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--baseline", type=Path, nargs="*", default=[])
    p.add_argument("--tabulate", action="store_true", help="run nothing: tabulate the finished runs in --out")
    args = p.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    modes = [m for m in args.modes.split(",") if m]
    if not seeds or args.repeats < 0 or args.rounds < 1 or set(modes) - set(MODES) or not modes:
        p.error("need seeds, --repeats >= 0, --rounds >= 1 and --modes among sync, async")
    args.out.mkdir(parents=True, exist_ok=True)
    loads_file = args.out / "loads.json"
    loads: dict[str, str] = json.loads(loads_file.read_text()) if loads_file.exists() else {}
    rows = []
    for mode, seed, rep in plan(seeds, args.repeats, modes):
        name = f"{mode}-r{rep}"
        if args.tabulate:
            done = sorted(args.out.glob(f"{name}-s{seed}-*/summary.json"), key=lambda f: f.stat().st_mtime)
            if not done:
                continue
            run = finished_run(done[-1].parent)
        else:
            run = emulate(args.out, name, MODES[mode], seed, args.rounds)
        key = run["folder"].name
        if key not in loads and not args.tabulate:
            loads[key] = " ".join(f"{x:.1f}" for x in os.getloadavg())
            loads_file.write_text(json.dumps(loads, indent=1, sort_keys=True))
        rows.append({"mode": mode, "seed": seed, "repeat": rep, "load": loads.get(key, "-"), **row(run)})
        (args.out / "results.md").write_text(table(rows, []))
    baseline = [statistics.mean(json.loads(x)["wall_s"] for x in (d / "rounds.jsonl").read_text().splitlines()
                                if x.strip()) for d in args.baseline if (d / "rounds.jsonl").exists()]
    text = table(rows, baseline)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
