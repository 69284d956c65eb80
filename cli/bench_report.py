"""``flayer bench`` results: per-run measures, per-method aggregates, CSV, markdown and plots.

Definitions (also in docs/results/bench-fmnist.md):

- final accuracy: the clients' deployable models after the last round (``personal_model``, e.g.
  FedBABU's fine-tuned model), sample-weighted over all clients' test splits;
- best accuracy: the best of every round's evaluation (after the download, before training) and
  the final one -- PFLlib reports the best round;
- rounds to FedAvg's best: the first round whose evaluation reaches FedAvg's best round accuracy
  *of the same seed*;
- convergence round: with m_r the mean accuracy of rounds r-4..r (5-round moving average, r >= 5),
  the smallest r such that m never again exceeds m_r by more than 0.1 percentage points in a later
  round; when that is the last round the curve was still rising (marked ``*``: a lower bound);
- upload per client per round: the wire codec's bytes (fp32 values, the default codec) over the
  uploads the clients made.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, stdev
from typing import Any

__all__ = [
    "TOLERANCE",
    "WINDOW",
    "MethodRow",
    "RunResult",
    "aggregate",
    "convergence_round",
    "finished_summary",
    "load_run",
    "markdown_table",
    "plot_accuracy",
    "plot_client_spread",
    "rounds_to_reach",
    "write_csv",
]

WINDOW = 5
TOLERANCE = 0.001  # 0.1 percentage points, accuracies being fractions


@dataclass(frozen=True)
class RunResult:
    method: str
    seed: int
    acc: tuple[float, ...]  # per round
    final_acc: float
    final_round_acc: float
    best_acc: float
    final_client_acc: tuple[float, ...]
    wall_seconds: float
    upload_bytes_per_round: float  # per client per round
    calibration: Mapping[str, Any] = field(default_factory=dict)
    cpu_seconds: float = math.nan  # process CPU time of the simulation (one thread: ~ wall time on a free core)
    diverged: bool = False  # the run stopped early (non-finite or blown-up loss); its figures are up to then


def finished_summary(summary_path: Path, method: str, rounds: int) -> dict[str, Any] | None:
    """The ``summary.json`` of a finished run of ``method`` over ``rounds`` rounds (a diverged run stopped
    early, and is finished with fewer), or None when it is missing, unreadable or from other settings."""
    try:
        s = json.loads(summary_path.read_text())
        if not isinstance(s, dict) or s["strategy"] != method or (len(s["acc"]) != rounds and not s.get("diverged")):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return s


def load_run(summary_path: Path, method: str, seed: int, rounds: int) -> RunResult | None:
    """A finished run's result, or None when its summary is missing, unreadable or from other settings."""
    s = finished_summary(summary_path, method, rounds)
    try:
        if s is None or int(s["seed"]) != seed:
            return None
        uploads = int(s.get("uploads", 0))
        total = int(s["upload_bytes_total"])
        return RunResult(method, seed, tuple(float(a) for a in s["acc"]), float(s["final_personal_acc"]),
                         float(s["final_round_acc"]), float(s["best_acc"]),
                         tuple(float(a) for a in s["final_client_acc"]), float(s["wall_seconds"]),
                         total / uploads if uploads else 0.0, dict(s.get("calibration") or {}),
                         float(s.get("cpu_seconds", math.nan)), bool(s.get("diverged")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rounds_to_reach(acc: Sequence[float], target: float) -> int | None:
    """The first round (1-based) whose accuracy reaches ``target``; None if none does."""
    for i, a in enumerate(acc):
        if a >= target - 1e-12:
            return i + 1
    return None


def convergence_round(acc: Sequence[float], window: int = WINDOW, tol: float = TOLERANCE) -> int | None:
    """The smallest round r >= ``window`` after which the ``window``-round moving average never again
    rises more than ``tol`` above its value at r (see module docstring); None when there are fewer
    than ``window`` rounds."""
    if len(acc) < window:
        return None
    ma = [mean(acc[i - window + 1:i + 1]) for i in range(window - 1, len(acc))]  # ma[j] is round j + window
    later_max = -math.inf
    best = len(acc)
    for j in range(len(ma) - 1, -1, -1):
        if later_max <= ma[j] + tol:
            best = j + window
        later_max = max(later_max, ma[j])
    return best


def _ms(values: Sequence[float]) -> tuple[float, float]:
    return (mean(values), stdev(values) if len(values) > 1 else 0.0) if values else (math.nan, math.nan)


@dataclass(frozen=True)
class MethodRow:
    method: str
    seeds: int
    final: tuple[float, float]
    best: tuple[float, float]
    final_round: tuple[float, float]
    to_fedavg_best: float | None  # mean over the seeds that reached it
    reached: int  # seeds that reached FedAvg's best
    convergence: tuple[float, float]
    still_rising: int  # seeds whose convergence round is the last round
    upload_bytes: float
    wall: tuple[float, float]
    cpu: tuple[float, float]
    calibration: tuple[str, ...]
    to_target: float | None = None  # rounds to --target accuracy, mean over the seeds that reached it
    target_reached: int = 0
    cpu_to_target: float | None = None  # the CPU seconds of those rounds, mean over the same seeds
    diverged: int = 0  # seeds whose run diverged (stopped early)


def aggregate(runs: Sequence[RunResult], methods: Sequence[str],
              target: float | None = None) -> tuple[list[MethodRow], dict[tuple[str, int], dict]]:
    """Per-method rows (in ``methods`` order) and per-run derived measures keyed by (method, seed).
    ``target``: an accuracy (fraction) whose first round, and the CPU time to it, each run reports."""
    fedavg_best = {r.seed: max(r.acc) for r in runs if r.method == "fedavg"}
    per_run: dict[tuple[str, int], dict] = {}
    for r in runs:
        fb = fedavg_best.get(r.seed)
        hit = rounds_to_reach(r.acc, target) if target is not None else None
        per_run[(r.method, r.seed)] = {
            "to_fedavg_best": rounds_to_reach(r.acc, fb) if fb is not None else None,
            "convergence": convergence_round(r.acc),
            # rounds cost about the same each: the run's CPU time prorated to the round that hit the target
            "to_target": hit, "cpu_to_target": r.cpu_seconds * hit / len(r.acc) if hit is not None else None,
        }
    rows = []
    for m in methods:
        mine = [r for r in runs if r.method == m]
        if not mine:
            continue
        hits = [per_run[(r.method, r.seed)] for r in mine if per_run[(r.method, r.seed)]["to_target"] is not None]
        reached = [per_run[(r.method, r.seed)]["to_fedavg_best"] for r in mine]
        reached = [x for x in reached if x is not None]
        conv = [per_run[(r.method, r.seed)]["convergence"] for r in mine]
        conv_ok = [float(c) for c in conv if c is not None]
        rows.append(MethodRow(
            m, len(mine), _ms([r.final_acc for r in mine]), _ms([r.best_acc for r in mine]),
            _ms([r.final_round_acc for r in mine]), mean(reached) if reached else None, len(reached),
            _ms(conv_ok), sum(1 for r, c in zip(mine, conv) if c is not None and c >= len(r.acc)),
            mean(r.upload_bytes_per_round for r in mine),
            _ms([r.wall_seconds for r in mine]), _ms([r.cpu_seconds for r in mine]),
            tuple(sorted({json.dumps(dict(r.calibration), sort_keys=True) for r in mine if r.calibration})),
            mean(h["to_target"] for h in hits) if hits else None, len(hits),
            mean(h["cpu_to_target"] for h in hits) if hits else None, sum(r.diverged for r in mine)))
    return rows, per_run


def write_csv(path: Path, runs: Sequence[RunResult], per_run: Mapping[tuple[str, int], dict],
              rows: Sequence[MethodRow]) -> Path:
    """One CSV: a ``run`` row per (method, seed) and a ``method`` row per method (means and stds)."""
    cols = ["row", "method", "seed", "seeds", "final_acc", "final_acc_std", "best_acc", "best_acc_std",
            "final_round_acc", "final_round_acc_std", "rounds_to_fedavg_best", "seeds_reaching_fedavg_best",
            "convergence_round", "convergence_round_std", "rounds_to_target", "seeds_reaching_target",
            "cpu_seconds_to_target", "diverged", "upload_bytes_per_client_round",
            "wall_seconds", "wall_seconds_std", "cpu_seconds", "cpu_seconds_std", "calibration"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in runs:
            d = per_run[(r.method, r.seed)]
            w.writerow({"row": "run", "method": r.method, "seed": r.seed, "seeds": 1, "final_acc": r.final_acc,
                        "best_acc": r.best_acc, "final_round_acc": r.final_round_acc,
                        "rounds_to_fedavg_best": d["to_fedavg_best"] if d["to_fedavg_best"] is not None else "",
                        "seeds_reaching_fedavg_best": int(d["to_fedavg_best"] is not None),
                        "convergence_round": d["convergence"] if d["convergence"] is not None else "",
                        "rounds_to_target": "" if d["to_target"] is None else d["to_target"],
                        "seeds_reaching_target": int(d["to_target"] is not None),
                        "cpu_seconds_to_target": "" if d["cpu_to_target"] is None else round(d["cpu_to_target"], 1),
                        "diverged": int(r.diverged),
                        "upload_bytes_per_client_round": round(r.upload_bytes_per_round, 1),
                        "wall_seconds": round(r.wall_seconds, 1), "cpu_seconds": round(r.cpu_seconds, 1),
                        "calibration": json.dumps(dict(r.calibration))})
        for m in rows:
            w.writerow({"row": "method", "method": m.method, "seed": "", "seeds": m.seeds,
                        "final_acc": m.final[0], "final_acc_std": m.final[1], "best_acc": m.best[0],
                        "best_acc_std": m.best[1], "final_round_acc": m.final_round[0],
                        "final_round_acc_std": m.final_round[1],
                        "rounds_to_fedavg_best": "" if m.to_fedavg_best is None else m.to_fedavg_best,
                        "seeds_reaching_fedavg_best": m.reached, "convergence_round": m.convergence[0],
                        "convergence_round_std": m.convergence[1],
                        "rounds_to_target": "" if m.to_target is None else m.to_target,
                        "seeds_reaching_target": m.target_reached,
                        "cpu_seconds_to_target": "" if m.cpu_to_target is None else round(m.cpu_to_target, 1),
                        "diverged": m.diverged, "upload_bytes_per_client_round": round(m.upload_bytes, 1),
                        "wall_seconds": round(m.wall[0], 1), "wall_seconds_std": round(m.wall[1], 1),
                        "cpu_seconds": round(m.cpu[0], 1), "cpu_seconds_std": round(m.cpu[1], 1),
                        "calibration": " ".join(m.calibration)})
    return path


def _pct(ms: tuple[float, float], n: int) -> str:
    return f"{100 * ms[0]:.2f}" + (f" ± {100 * ms[1]:.2f}" if n > 1 else "")


def _reach(mean_rounds: float | None, reached: int, seeds: int) -> str:
    if mean_rounds is None:
        return "-"
    return f"{mean_rounds:.1f}" + ("" if reached == seeds else f" ({reached}/{seeds})")


def markdown_table(rows: Sequence[MethodRow], target: float | None = None) -> str:
    """The results table (accuracies in %, mean ± std over seeds; the std only with several seeds; a
    method whose runs diverged says how many, their figures being those up to the divergence).
    With ``target``, two more columns: the rounds to reach it and the CPU seconds of those rounds. The
    rounds to FedAvg's best are a column only where FedAvg is one of the rows."""
    up = "upload KB/client/round"
    fedavg = any(m.method == "fedavg" for m in rows)
    tcols = (f" rounds to {100 * target:g}% | CPU s to {100 * target:g}% |" if target is not None else "")
    header = ("| method | seeds | final acc (%) | best acc (%) |" + (" rounds to FedAvg best |" if fedavg else "")
              + f" convergence round |{tcols} {up} | wall s/run | CPU s/run |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for m in rows:
        reach = f" {_reach(m.to_fedavg_best, m.reached, m.seeds)} |" if fedavg else ""
        conv = "-" if math.isnan(m.convergence[0]) else (
            f"{m.convergence[0]:.1f}" + (f" ± {m.convergence[1]:.1f}" if m.seeds > 1 else ""))
        if m.still_rising:
            conv += "*"
        tvals = ""
        if target is not None:
            tvals = (f" {_reach(m.to_target, m.target_reached, m.seeds)} | "
                     f"{'-' if m.cpu_to_target is None else f'{m.cpu_to_target:.0f}'} |")
        name = m.method + (f" ({', '.join(m.calibration)})" if m.calibration else "")
        if m.diverged:
            name += f" **{m.diverged}/{m.seeds} diverged**"
        wall = f"{m.wall[0]:.0f}" + (f" ± {m.wall[1]:.0f}" if m.seeds > 1 else "")
        lines.append(f"| {name} | {m.seeds} | {_pct(m.final, m.seeds)} | {_pct(m.best, m.seeds)} |{reach} {conv} |"
                     f"{tvals} {m.upload_bytes / 1000:.1f} | {wall} | {m.cpu[0]:.0f} |")
    return "\n".join(lines)


def _pyplot() -> Any:
    from cli.plots import _pyplot as pp

    return pp()


def plot_accuracy(path: Path, runs: Sequence[RunResult], methods: Sequence[str], title: str) -> Path | None:
    """Accuracy per round, mean over seeds, one line per method."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    for k, m in enumerate(methods):
        series = [r.acc for r in runs if r.method == m]
        if not series:
            continue
        n = min(len(s) for s in series)
        # ten colours, then black; identical curves would hide each other: vary the dash too
        ax.plot(range(1, n + 1), [100 * mean(s[i] for s in series) for i in range(n)], label=m, linewidth=1.5,
                color=f"C{k}" if k < 10 else "black", linestyle=("-", "--", "-.", ":")[k % 4])
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%), mean over seeds")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_client_spread(path: Path, runs: Sequence[RunResult], methods: Sequence[str], title: str) -> Path | None:
    """Box plot of the clients' final accuracies per method (all seeds pooled)."""
    plt = _pyplot()
    if plt is None:
        return None
    present = [m for m in methods if any(r.method == m for r in runs)]
    data = [[100 * a for r in runs if r.method == m for a in r.final_client_acc] for m in present]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(present) + 2), 4.5), dpi=110)
    ax.boxplot(data)
    ax.set_xticks(range(1, len(present) + 1), present, rotation=30, fontsize=8)
    ax.set_ylabel("final test accuracy per client (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
