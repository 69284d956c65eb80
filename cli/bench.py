"""``flayer bench``: every method x every seed on one saved partition, in parallel processes,
resumable, then one results table (CSV + markdown) and two plots.

Layout of ``--out``::

    bench.json            the settings (a later call with other settings is refused)
    partition.npz         the partition every run reads (the seeds vary the training only)
    runs/<method>/seed<s>/  one ``flayer simulate`` run each: log.txt, metrics.jsonl, summary.json
    results.csv results.md accuracy_vs_round.png client_spread.png

A run whose ``summary.json`` is complete is never re-run, so an interrupted bench continues where
it stopped and a finished one only re-aggregates.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from cli.common import CliError, add_common_flags, load_data, run_config, write_json
from cli.logfile import add_log_file_flag
from cli.progress import Progress

REPO_ROOT = Path(__file__).resolve().parent.parent


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run every method x seed on one partition and tabulate the results",
                       description="Runs each (method, seed) as its own 'flayer simulate' process on one saved "
                                   "partition, skips runs already finished in --out, and writes results.csv, "
                                   "results.md, accuracy_vs_round.png and client_spread.png. --seed is the "
                                   "partition's seed; --seeds are the training seeds.")
    add_common_flags(p, rounds=True, strategy=False)
    add_log_file_flag(p)
    g = p.add_argument_group("bench")
    add_job_flags(g)
    g.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2)")
    g.add_argument("--target", type=float, metavar="ACC",
                   help="an accuracy (fraction, e.g. 0.94): the table adds each method's rounds to reach it "
                        "and the CPU seconds of those rounds")
    g.add_argument("--tuned", metavar="FILE", help="tuned.json from 'flayer tune': each method runs at the learning "
                                                   "rate (and options) chosen there on validation accuracy")
    g.add_argument("--tuned-pick", choices=("best", "stable"), default="best",
                   help="with --tuned: the best validation point (default), or the best one whose next-higher "
                        "rate did not diverge either (a margin, for data with more steps per round)")
    g.add_argument("--report-only", action="store_true",
                   help="start no run: tabulate the runs already finished in --out (e.g. while the bench "
                        "still runs elsewhere), and name the ones missing")
    p.set_defaults(func=run)


def add_job_flags(g: argparse._ArgumentGroup) -> None:
    """The flags that ``flayer bench`` and ``flayer tune`` share: which methods, how runs are spread
    over processes, and the training settings every run gets."""
    g.add_argument("--methods", default="all", help="comma-separated strategy names, or 'all' (default)")
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="runs in parallel (default: the number of CPU cores)")
    g.add_argument("--threads-per-job", type=int, default=1, help="torch threads per run (default 1)")
    g.add_argument("--lr", type=float, help="base learning rate")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--local-epochs", type=int)
    g.add_argument("--device", help="auto, cpu (default), cuda, cuda:N or mps")
    g.add_argument("--set", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="a strategy option passed to every run, e.g. --set ditto.mu=0.5")


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--{what} {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not out or len(set(out)) != len(out):
        raise CliError(f"--{what} {text!r}: expected distinct integers, e.g. 0,1,2")
    return out


def _methods(text: str) -> list[str]:
    from flayer.config import STRATEGY_NAMES

    if text.strip() == "all":
        return list(STRATEGY_NAMES)
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in STRATEGY_NAMES]
    if bad or not names:
        raise CliError(f"--methods: unknown {', '.join(bad) or 'empty list'}; choose from all, "
                       f"{', '.join(STRATEGY_NAMES)}")
    return list(dict.fromkeys(names))


def _settings(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """What the runs' results depend on (a resumed bench must match it)."""
    return {"dataset": cfg.data.dataset, "data_dir": cfg.data.data_dir, "samples": cfg.data.samples,
            "partition": cfg.data.partition, "clients": cfg.data.clients, "partition_seed": cfg.seed,
            "partition_file": cfg.data.partition_file, "model": cfg.data.model, "rounds": cfg.rounds,
            "join_ratio": cfg.join_ratio, "lr": args.lr, "batch_size": args.batch_size,
            "local_epochs": args.local_epochs, "device": args.device, "set": list(args.set),
            "config": Path(args.config).read_text() if args.config else None}


def _prepare_out(args: argparse.Namespace, cfg: Any, out: Path, name: str = "bench.json",
                 extra: dict[str, Any] | None = None, growable: tuple[str, ...] = ()) -> Path:
    """Write or check the settings file ``name``; make or reuse the saved partition. Returns the
    partition file. A ``growable`` setting may gain values (a list) or entries (a dict: the tuned choice
    of each method, whose shared entries must agree): the finished runs stay valid, and the file keeps
    the union."""
    from flayer.partition import save_partition

    settings = check_settings(out / name, {**_settings(args, cfg), **(extra or {})}, "a bench", growable)
    part_file = out / "partition.npz"
    if not part_file.is_file():
        prepared = load_data(cfg)
        save_partition(prepared.partition, part_file)
    write_json(out / name, settings)
    return part_file


def check_settings(sfile: Path, settings: dict[str, Any], what: str,
                   growable: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings to write to ``sfile``: ``settings``, after refusing (CliError) a folder whose
    ``sfile`` holds ``what`` with other settings; a ``growable`` dict keeps the union of both."""
    if not sfile.is_file():
        return settings
    try:
        old = json.loads(sfile.read_text())
    except ValueError:
        raise CliError(f"{sfile} is not valid JSON; remove it or use another --out") from None
    diff = sorted(k for k in set(old) | set(settings)
                  if old.get(k) != settings.get(k) and not (k in growable and _grows(old.get(k), settings.get(k))))
    if diff:
        raise CliError(f"{sfile.parent} holds {what} with other settings ({', '.join(diff)} differ); "
                       f"use another --out or the same flags")
    merged = dict(settings)
    for k in growable:
        if isinstance(old.get(k), dict) and isinstance(settings.get(k), dict):
            merged[k] = {**old[k], **settings[k]}
    return merged


def _grows(old: Any, new: Any) -> bool:
    """True when ``new`` is compatible with ``old``: a list only gains values; two dicts agree on the
    keys they share (a bench with more, or other, tuned methods)."""
    if isinstance(old, list) and isinstance(new, list):
        return set(old) <= set(new)
    if isinstance(old, dict) and isinstance(new, dict):
        return all(new[k] == v for k, v in old.items() if k in new)
    return False


def _run_command(args: argparse.Namespace, cfg: Any, method: str, seed: int, part_file: Path,
                 run_dir: Path, lr: float | None = None, sets: tuple[str, ...] = (),
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The ``flayer simulate`` command of one run; ``lr`` and ``sets`` override the flags'."""
    cmd = [sys.executable, "-m", "cli.main", "simulate", "--strategy", method, "--seed", str(seed),
           "--rounds", str(cfg.rounds), "--join-ratio", str(cfg.join_ratio), "--dataset", cfg.data.dataset,
           "--clients", str(cfg.data.clients), "--partition-file", str(part_file.resolve()),
           "--threads", str(args.threads_per_job), "--device", args.device or "cpu", "--out", str(run_dir.resolve())]
    if args.config:
        cmd += ["--config", str(Path(args.config).resolve())]
    for flag, value in (("--data-dir", cfg.data.data_dir), ("--model", cfg.data.model),
                        ("--lr", lr if lr is not None else args.lr),
                        ("--batch-size", args.batch_size), ("--local-epochs", args.local_epochs)):
        if value is not None:
            cmd += [flag, str(value)]
    for item in [*args.set, *sets]:
        cmd += ["--set", item]
    return cmd + list(extra)


def _execute(cmd: list[str], run_dir: Path, threads: int) -> tuple[int, float]:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    t0 = time.monotonic()
    with open(run_dir / "log.txt", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT).returncode
    return rc, time.monotonic() - t0


def run_all(runs: list[tuple[str, list[str], Path]], jobs: int, threads: int, name: str) -> list[str]:
    """Run each ``(label, command, run_dir)`` as its own process, ``jobs`` at a time, with progress;
    returns a line for each run that failed."""
    failed: list[str] = []
    if not runs:
        return failed
    progress = Progress(len(runs), name)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_execute, cmd, rdir, threads): (label, rdir) for label, cmd, rdir in runs}
        for n, fut in enumerate(as_completed(futures), 1):
            label, rdir = futures[fut]
            rc, secs = fut.result()
            if rc != 0:
                failed.append(f"{label} (exit {rc}, see {rdir / 'log.txt'})")
            progress.update(n, f"{label} {'done' if rc == 0 else 'FAILED'} in {secs:.0f}s")
    progress.close()
    return failed


def check_jobs(args: argparse.Namespace) -> None:
    if args.jobs < 1 or args.threads_per_job < 1:
        raise CliError("--jobs and --threads-per-job must be >= 1")


def run(args: argparse.Namespace) -> int:
    from cli import bench_report as rep
    from cli.tuned import load_tuned

    check_jobs(args)
    if args.target is not None and not (math.isfinite(args.target) and 0 < args.target <= 1):
        raise CliError(f"--target {args.target}: expected an accuracy in (0, 1], e.g. 0.94")
    methods = _methods(args.methods)
    seeds = _int_list(args.seeds, "seeds")
    if args.tuned and (args.lr is not None or args.set):
        raise CliError("--tuned sets each method's learning rate and options: drop --lr and --set")
    cfg = run_config(argparse.Namespace(**{**vars(args), "strategy": None}))
    tuned = load_tuned(Path(args.tuned), methods, cfg, args.tuned_pick) if args.tuned else {}
    out = Path(cfg.out) if cfg.out else Path("runs") / f"bench-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.report_only and not (out / "bench.json").is_file():
        raise CliError(f"--report-only: {out} holds no bench (no bench.json); give the --out of a bench")
    out.mkdir(parents=True, exist_ok=True)
    part_file = _prepare_out(args, cfg, out, extra={"tuned": {m: c.as_dict() for m, c in tuned.items()}}
                             if tuned else None, growable=("tuned",))

    def run_dir(m: str, s: int) -> Path:
        return out / "runs" / m / f"seed{s}"

    def command(m: str, s: int) -> list[str]:
        choice = tuned.get(m)
        return _run_command(args, cfg, m, s, part_file, run_dir(m, s), lr=choice.lr if choice else None,
                            sets=choice.sets if choice else ())

    if tuned:
        reused = reuse_tuning_runs(Path(args.tuned), out, tuned, seeds, cfg.rounds, run_dir)
        if reused:
            print(f"flayer bench: {len(reused)} run(s) taken from the tuning, which ran the same command "
                  f"({', '.join(reused)})", file=sys.stderr)
    todo = [(m, s) for s in seeds for m in methods
            if rep.load_run(run_dir(m, s) / "summary.json", m, s, cfg.rounds) is None]
    done_before = len(methods) * len(seeds) - len(todo)
    print(f"flayer bench: {len(methods)} methods x {len(seeds)} seeds = {len(methods) * len(seeds)} runs; "
          f"{done_before} already done in {out}, {len(todo)} to run, {min(args.jobs, max(1, len(todo)))} at a time",
          file=sys.stderr)
    if args.report_only:
        if not done_before:
            raise CliError(f"--report-only: no finished run in {out}")
        if todo:
            print(f"flayer bench: --report-only: {len(todo)} run(s) not finished, left out of the table: "
                  f"{', '.join(f'{m} seed{s}' for m, s in todo)}", file=sys.stderr)
        failed: list[str] = []
    else:
        failed = run_all([(f"{m} seed{s}", command(m, s), run_dir(m, s)) for m, s in todo], args.jobs,
                         args.threads_per_job, "bench")
    runs = [r for s in seeds for m in methods
            if (r := rep.load_run(run_dir(m, s) / "summary.json", m, s, cfg.rounds)) is not None]
    if not runs:
        raise CliError(f"no run finished; see the log.txt files under {out / 'runs'}")
    rows, per_run = rep.aggregate(runs, methods, args.target)
    rep.write_csv(out / "results.csv", runs, per_run, rows)
    title = (f"{cfg.data.dataset} {cfg.data.partition}, {cfg.data.clients} clients, "
             f"{cfg.data.samples or 'all'} samples, {cfg.rounds} rounds, seeds {','.join(map(str, seeds))}")
    table = rep.markdown_table(rows, args.target)
    (out / "results.md").write_text(f"{title}\n\n{table}\n")
    rep.plot_accuracy(out / "accuracy_vs_round.png", runs, methods, title)
    rep.plot_client_spread(out / "client_spread.png", runs, methods, title)
    print(title + "\n")
    print(table)
    print(f"\noutputs in {out}/ (results.csv, results.md, accuracy_vs_round.png, client_spread.png, runs/)",
          file=sys.stderr)
    if failed:
        raise CliError(f"{len(failed)} run(s) failed: {'; '.join(failed)}")
    return 0


def reuse_tuning_runs(tuned_file: Path, out: Path, tuned: dict[str, Any], seeds: list[int], rounds: int,
                      run_dir: Any) -> list[str]:
    """Copy the tuning's run of each method at its chosen point into ``out`` as the run of the tuning's
    training seed, when that run is the one this bench would start: same settings (``tune.json`` against
    ``bench.json``, the tuning's own keys aside) and the same partition arrays. Returns the runs copied."""
    import shutil

    from cli import bench_report as rep
    from cli.tuned import Point

    tune_dir = tuned_file.parent
    try:
        tset = json.loads((tune_dir / "tune.json").read_text())
        bset = json.loads((out / "bench.json").read_text())
        same_part = _same_arrays(tune_dir / "partition.npz", out / "partition.npz")
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # no readable tuning beside tuned.json
        return []
    own = {"lrs", "grid", "train_seed", "blowup", "tuned"}
    if not same_part or not isinstance(tset, dict) or any(tset.get(k) != bset.get(k) for k in set(bset) - own):
        return []
    seed = tset.get("train_seed")
    if seed not in seeds:
        return []
    copied = []
    for m, c in tuned.items():
        dst = run_dir(m, seed)
        src = tune_dir / "runs" / m / Point(m, c.lr, c.sets).label
        if rep.load_run(dst / "summary.json", m, seed, rounds) is not None:
            continue
        run = rep.load_run(src / "summary.json", m, seed, rounds)
        if run is None or run.diverged:
            continue
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        copied.append(f"{m} seed{seed}")
    return copied


def _same_arrays(a: Path, b: Path) -> bool:
    """True when the two ``.npz`` files hold the same named arrays."""
    import numpy as np

    with np.load(a, allow_pickle=False) as za, np.load(b, allow_pickle=False) as zb:
        return set(za.files) == set(zb.files) and all(np.array_equal(za[k], zb[k]) for k in za.files)
