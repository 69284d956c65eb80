"""``flayer tune``: each method's base learning rate (and optional knobs) chosen on validation accuracy.

Every (method, learning rate, knob values) of the grid runs as one ``flayer simulate`` process on one
saved partition and one training seed, in parallel jobs, resumable like ``flayer bench``. The choice
for a method is the grid point with the highest *validation* accuracy: the best sample-weighted
accuracy on the clients' validation hold-outs (10% of each training share) over every round's
received models and the personal models at the end, the same models the best test figure is taken
over (FedBABU is judged by its fine-tuned personal models, so it is tuned by them too). The test
split is recorded beside it but never steers the choice. A run whose loss
is not finite or blows up (over ``--blowup`` x ln(classes)) stops early and is recorded as diverged;
the tuning goes on.

Layout of ``--out``::

    tune.json             the settings (a later call with other settings is refused, except a wider
                          --lrs: the grid grows and the finished runs count)
    partition.npz         the partition every run reads
    runs/<method>/<point>/  one ``flayer simulate`` run each (point: lr0.05, lr0.05_mu=0.1, ...)
    tuned.json            the grid, every run's validation and test accuracy, the choice per method
    tuned.md              the same as a table

``flayer bench --tuned OUT/tuned.json`` then runs each method at its chosen point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cli.common import CliError, add_common_flags, run_config, write_json
from cli.tuned import FORMAT, Choice, Point

DEFAULT_LRS = "0.005,0.01,0.02,0.05,0.1"
CRITERION = ("best sample-weighted accuracy on the clients' validation hold-outs, over every round's received "
             "models and the personal models at the end (the models the best test figure is taken over)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from cli.bench import add_job_flags

    p = sub.add_parser("tune", help="choose each method's learning rate on validation accuracy (for bench --tuned)",
                       description="Runs every method at every grid point (learning rates x optional knobs) on one "
                                   "partition and one training seed, skips runs already finished in --out, and "
                                   "chooses per method the point with the best validation accuracy (never the test "
                                   "split). Writes tuned.json for 'flayer bench --tuned'.")
    add_common_flags(p, rounds=True, strategy=False)
    g = p.add_argument_group("tune")
    add_job_flags(g)
    g.add_argument("--lrs", default=DEFAULT_LRS, help=f"comma-separated base learning rates (default {DEFAULT_LRS})")
    g.add_argument("--grid", action="append", default=[], metavar="STRATEGY.KEY=V1,V2",
                   help="a method's knob to tune too, e.g. --grid ditto.mu=0.01,0.1,1 (repeatable)")
    g.add_argument("--train-seed", type=int, default=0, help="the training seed of every run (default 0)")
    g.add_argument("--blowup", type=float, default=10.0,
                   help="a run whose mean training loss exceeds this x ln(classes) (a uniform guess's loss) is "
                        "stopped as diverged (default 10)")
    p.set_defaults(func=run)


def parse_lrs(text: str) -> list[float]:
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--lrs {text!r}: expected comma-separated numbers, e.g. {DEFAULT_LRS}") from None
    if not lrs or len(set(lrs)) != len(lrs) or not all(math.isfinite(x) and 0 < x <= 10 for x in lrs):
        raise CliError(f"--lrs {text!r}: expected distinct learning rates in (0, 10]")
    return lrs


def parse_grid(items: Sequence[str], methods: Sequence[str]) -> dict[str, list[list[str]]]:
    """``["ditto.mu=0.01,0.1"]`` -> ``{"ditto": [["ditto.mu=0.01", "ditto.mu=0.1"]]}`` (one list per knob)."""
    from cli.common import parse_set

    grid: dict[str, list[list[str]]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        method, dot, name = key.partition(".")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or not dot or not name or not vals:
            raise CliError(f"--grid {item!r}: expected STRATEGY.KEY=V1,V2, e.g. ditto.mu=0.01,0.1,1")
        if method not in methods:
            raise CliError(f"--grid {item!r}: {method!r} is not among the tuned methods ({', '.join(methods)})")
        sets = [f"{key}={v}" for v in vals]
        parse_set(sets)  # each value must be a TOML value
        grid.setdefault(method, []).append(sets)
    return grid


def grid_points(methods: Sequence[str], lrs: Sequence[float], grid: dict[str, list[list[str]]]) -> list[Point]:
    points = []
    for m in methods:
        for lr in lrs:
            for combo in itertools.product(*grid.get(m, [])):
                points.append(Point(m, lr, tuple(combo)))
    return points


def deploys_received(method: str) -> bool:
    """True when ``method``'s personal model at the end is the model it receives each round (every
    method but FedBABU, which fine-tunes its head first)."""
    from flayer.strategies import STRATEGIES, Strategy

    return STRATEGIES[method].personal_model is Strategy.personal_model


def read_run(summary_path: Path, point: Point, rounds: int) -> dict[str, Any] | None:
    """A finished run's row, or None when it has not finished (or ran other settings).

    A summary written before the personal models were validated at the end (no
    ``final_personal_val_acc``) still counts for a method that deploys its received model: its
    rounds validated that kind of model. For FedBABU it does not: the run must be redone."""
    from cli.bench_report import finished_summary

    s = finished_summary(summary_path, point.method, rounds)
    if s is None or ("final_personal_val_acc" not in s and not deploys_received(point.method)):
        return None
    try:
        return {"method": point.method, "lr": point.lr, "set": list(point.sets), "label": point.label,
                "best_val_acc": s.get("best_val_acc"), "best_test_acc": float(s["best_acc"]),
                "final_personal_val_acc": s.get("final_personal_val_acc"),
                "final_personal_acc": float(s["final_personal_acc"]), "rounds_run": len(s["acc"]),
                "diverged": s.get("diverged"), "wall_seconds": float(s["wall_seconds"]),
                "cpu_seconds": float(s.get("cpu_seconds", math.nan))}
    except (ValueError, KeyError, TypeError):
        return None


def choose(rows: Sequence[dict[str, Any]]) -> dict[str, Choice]:
    """Per method, the row with the highest validation accuracy among the runs that did not diverge;
    ties go to the earlier grid point. Test accuracy is carried along, never compared."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        val = row.get("best_val_acc")
        if row.get("diverged") or val is None or not math.isfinite(val):
            continue
        cur = best.get(row["method"])
        if cur is None or val > cur["best_val_acc"]:
            best[row["method"]] = row
    return {m: Choice(m, float(r["lr"]), tuple(r["set"]), float(r["best_val_acc"]), float(r["best_test_acc"]))
            for m, r in best.items()}


STABLE = ("the best validation accuracy among the grid points whose next-higher learning rate (same knobs) "
          "also ran to the end without diverging: a factor-2 margin from divergence")


def choose_stable(rows: Sequence[dict[str, Any]]) -> dict[str, Choice]:
    """Per method, :func:`choose` over the points whose next-higher learning rate in the grid (with
    the same knobs) finished without diverging; the grid's top rate is never such a point. A rate at
    the edge of divergence on one data set can diverge on a larger one (more steps per round): this
    choice keeps a margin, and gives the defaults."""
    lines: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for row in rows:
        lines.setdefault((row["method"], tuple(row["set"])), []).append(row)
    eligible = []
    for line in lines.values():
        line = sorted(line, key=lambda r: r["lr"])
        eligible += [lo for lo, hi in zip(line, line[1:]) if not hi.get("diverged")]
    order = {id(r): i for i, r in enumerate(rows)}  # ties still go to the earlier grid point
    return choose(sorted(eligible, key=lambda r: order[id(r)]))


def markdown(rows: Sequence[dict[str, Any]], choice: dict[str, Choice],
             stable: dict[str, Choice] | None = None) -> str:
    from cli.report import table

    def pct(x: Any) -> str:
        return "-" if x is None else f"{100 * float(x):.2f}"

    body = []
    for r in rows:
        c = choice.get(r["method"])
        chosen = c is not None and c.lr == r["lr"] and list(c.sets) == r["set"]
        lrs = [x["lr"] for x in rows if x["method"] == r["method"]]
        edge = chosen and len(set(lrs)) > 1 and r["lr"] in (min(lrs), max(lrs))
        st = (stable or {}).get(r["method"])
        marks = [("**chosen**, at the grid's edge" if edge else "**chosen**") if chosen else "",
                 "stable" if st is not None and st.lr == r["lr"] and list(st.sets) == r["set"] else ""]
        body.append((r["method"], r["label"], pct(r["best_val_acc"]), pct(r["best_test_acc"]),
                     r["diverged"] or "", ", ".join(m for m in marks if m)))
    return table(["method", "point", "best val acc %", "best test acc %", "diverged", ""], body, markdown=True)


def run(args: argparse.Namespace) -> int:
    from cli.bench import _methods, _prepare_out, _run_command, check_jobs, run_all
    from cli.simulate import check_blowup

    check_jobs(args)
    check_blowup(args.blowup)
    if args.lr is not None:
        raise CliError("--lr is what tune chooses: give the grid with --lrs")
    methods = _methods(args.methods)
    lrs = parse_lrs(args.lrs)
    grid = parse_grid(args.grid, methods)
    cfg = run_config(argparse.Namespace(**{**vars(args), "strategy": None}))
    out = Path(cfg.out) if cfg.out else Path("runs") / f"tune-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    part_file = _prepare_out(args, cfg, out, name="tune.json",
                             extra={"lrs": lrs, "grid": args.grid, "train_seed": args.train_seed,
                                    "blowup": args.blowup}, growable=("lrs",))
    points = grid_points(methods, lrs, grid)

    def run_dir(pt: Point) -> Path:
        return out / "runs" / pt.method / pt.label

    todo = [pt for pt in points if read_run(run_dir(pt) / "summary.json", pt, cfg.rounds) is None]
    print(f"flayer tune: {len(methods)} methods, {len(points)} grid points; {len(points) - len(todo)} already done "
          f"in {out}, {len(todo)} to run, {min(args.jobs, max(1, len(todo)))} at a time", file=sys.stderr)
    failed = run_all([(f"{pt.method} {pt.label}",
                       _run_command(args, cfg, pt.method, args.train_seed, part_file, run_dir(pt), lr=pt.lr,
                                    sets=pt.sets, extra=("--blowup", str(args.blowup))), run_dir(pt))
                      for pt in todo], args.jobs, args.threads_per_job, "tune")
    rows = [r for pt in points if (r := read_run(run_dir(pt) / "summary.json", pt, cfg.rounds)) is not None]
    if not rows:
        raise CliError(f"no run finished; see the log.txt files under {out / 'runs'}")
    choice, stable = choose(rows), choose_stable(rows)
    settings = json.loads((out / "tune.json").read_text())
    write_json(out / "tuned.json", {"format": FORMAT, "criterion": CRITERION, "stable_criterion": STABLE,
                                    "settings": settings, "grid": {"lrs": lrs, "knobs": args.grid}, "runs": rows,
                                    "choice": {m: c.as_dict() for m, c in choice.items()},
                                    "stable_choice": {m: c.as_dict() for m, c in stable.items()}})
    title = (f"{cfg.data.dataset} {cfg.data.partition}, {cfg.data.clients} clients, {cfg.data.samples or 'all'} "
             f"samples, {cfg.rounds} rounds, training seed {args.train_seed}; chosen on: {CRITERION}; stable: "
             f"{STABLE}")
    text = markdown(rows, choice, stable)
    (out / "tuned.md").write_text(f"{title}\n\n{text}\n")
    print(title + "\n")
    print(text)
    unchosen = [m for m in methods if m not in choice]
    if unchosen:
        print(f"\nno choice for {', '.join(unchosen)}: every finished grid point diverged", file=sys.stderr)
    print(f"\noutputs in {out}/ (tuned.json, tuned.md, runs/); next: flayer bench --tuned {out / 'tuned.json'} ...",
          file=sys.stderr)
    if failed:
        raise CliError(f"{len(failed)} run(s) failed: {'; '.join(failed)}")
    return 0
