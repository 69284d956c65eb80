"""``make demo`` as shipped, against the plain settings, over seeds: the measurement behind the defaults.

Runs ``flayer emulate --config configs/emulate-demo.toml`` (20 devices over a real broker, FLAYER on
Fashion-MNIST Dir(0.1), 20 rounds) per seed in three variants:

- ``shipped``: the config exactly as ``make demo`` runs it (no flags but ``--seed``);
- ``async``: the same with ``--mode async`` and nothing else (``max_staleness`` and ``concurrency`` at
  their defaults, which follow from the buffer and the fleet);
- ``plain``: synchronous, the thin-link settings off (``--upload plan --no-error-feedback
  --delta-downloads off --value-codec fp32``): what the demo shipped before.

Tabulates, over seeds: each profile's updates accepted / trained, MB down and up per round (every byte
over the devices' emulated links), the personal models' final accuracy (mean over devices) and the
last round's accuracy. Each run's folder is keyed by every setting and the code (:func:`thin_demo.settings_key`),
so a changed config, flag or module is a new run; finished runs are reused (resumable):

    python benchmarks/demo_defaults.py --out docs/results/demo-defaults
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from thin_demo import PLAIN, ROOT, emulate

VARIANTS = {"shipped": [], "async": ["--mode", "async"], "plain": PLAIN}
LABELS = {"shipped": "shipped (sync: fit + error feedback, int8 deltas)",
          "async": "shipped + `--mode async`", "plain": "plain (sync, fp32, full downloads)"}


def _mean(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "-"
    sd = f" ± {statistics.stdev(xs):.{digits}f}" if len(xs) > 1 else ""
    return f"{statistics.mean(xs):.{digits}f}{sd}"


def answers(folder: Path) -> dict[str, dict[str, int]]:
    """Per profile, how the coordinator answered the devices' updates: ``refused`` (late, stale, in_buffer,
    ...) and ``accepted`` (update, round) pairs, from the devices' ack events; kept in ``answers.json``
    beside the run (the events stay local)."""
    path = folder / "answers.json"
    if path.exists():
        return json.loads(path.read_text())
    final: dict[tuple[str, str, int], str] = {}
    for f in sorted((folder / "events").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            e = json.loads(line) if line.strip() else {}
            if e.get("kind") == "ack" and e.get("round", 0) > 0:
                key = (e["profile"], e["device"], e["round"])
                if final.get(key) not in ("accepted", "duplicate"):  # an accepted update stays accepted
                    final[key] = e["status"]
    out: dict[str, dict[str, int]] = {}
    for (profile, _, _), status in final.items():
        kind = "accepted" if status in ("accepted", "duplicate") else "refused"
        out.setdefault(profile, {"accepted": 0, "refused": 0})[kind] += 1
    path.write_text(json.dumps(out, indent=1, sort_keys=True))
    return out


def _share(runs: list[dict[str, Any]], profile: str) -> str:
    """accepted / trained, and of the rest how many were refused and how many had no answer by the end."""
    acc = sum(p["accepted"] for r in runs for p in r["summary"]["profiles"] if p["profile"] == profile)
    tr = sum(p["trained"] for r in runs for p in r["summary"]["profiles"] if p["profile"] == profile)
    refused = sum(r["answers"].get(profile, {}).get("refused", 0) for r in runs)
    rest = f" ({refused} refused, {max(0, tr - acc - refused)} unanswered at the end)" if tr > acc else ""
    return f"{acc}/{tr} = {100 * acc / tr:.0f}%{rest}" if tr else "-"


def personal_acc(run: dict[str, Any]) -> float:
    """The personal models' final accuracy, mean over the devices that saved one."""
    accs = [d["final_acc"] for d in run["devices"] if d.get("final_acc") is not None]
    return 100 * statistics.mean(accs) if accs else float("nan")


def table(results: dict[str, list[dict[str, Any]]], seeds: list[int], rounds: int, commit: str) -> str:
    names = list(results)
    caption = (f"`make demo`'s fleet (`configs/emulate-demo.toml`: 20 devices, FLAYER, Fashion-MNIST Dir(0.1)), "
               f"{rounds} rounds, seeds {', '.join(map(str, seeds))}, mean ± std over seeds; "
               f"`python benchmarks/demo_defaults.py --out docs/results/demo-defaults` (code at {commit}).")
    lines = [caption, "",
             "| | " + " | ".join(LABELS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    profiles = sorted({p["profile"] for rs in results.values() for r in rs for p in r["summary"]["profiles"]})
    for prof in profiles:
        lines.append(f"| {prof}: updates accepted / trained | " + " | ".join(_share(results[n], prof) for n in names)
                     + " |")
    for label, key in (("MB down per round", "mb_down"), ("MB up per round", "mb_up")):
        cells = [_mean([statistics.mean(x[key] for x in r["rounds"]) for r in results[n]]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| personal models' final accuracy % | "
                 + " | ".join(_mean([personal_acc(r) for r in results[n]]) for n in names) + " |")
    lines.append("| last round's accuracy % | "
                 + " | ".join(_mean([100 * r["summary"]["final_acc"] for r in results[n]]) for n in names) + " |")
    lines.append("| rounds (versions) finished | "
                 + " | ".join(_mean([float(len(r["rounds"])) for r in results[n]], 0) for n in names) + " |")
    lines.append("| wall seconds per run | "
                 + " | ".join(_mean([r["summary"]["run_s"] for r in results[n]], 0) for n in names) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/demo-defaults")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {', '.join(VARIANTS)}")
    args = p.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for s in seeds:  # seed by seed, the variants side by side: a busy spell of the machine hits them alike
        for n in names:
            run = emulate(args.out, n, VARIANTS[n], s, args.rounds)
            results[n].append({**run, "answers": answers(run["folder"])})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip() or "unknown"
    text = table(results, seeds, args.rounds, commit)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
