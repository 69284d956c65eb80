"""``flayer ablate``: FLAYER with each mechanism switched off in turn, the literal server rule, and the
released code's preset with and without its learning-rate factor, on one partition over one or more
training seeds; a table (mean ± std over seeds) and an accuracy-vs-round plot. Resumable: a variant's
seed whose run finished in ``--out`` is not run again.

The ``zero`` row measures the published review's objection (Algorithm 1 read literally zeroes
every coordinate no client uploads) instead of arguing about it. With ``--tuned FILE`` (from
``flayer tune``) each variant runs at its method's chosen learning rate, so the rows compare
mechanisms, not learning rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from cli.common import CliError, add_common_flags, load_data, run_config, set_threads, write_json
from cli.logfile import add_log_file_flag
from cli.report import table

log = logging.getLogger(__name__)

# name -> (strategy, option overrides, what the row changes)
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "flayer": ("flayer", {}, "all three mechanisms, rule carry"),
    "no-pla": ("flayer", {"pla": False}, "global head instead of Eq. 2"),
    "no-head-epoch": ("flayer", {"head_epoch": False}, "no head-only epoch after PLA"),
    "no-lr-rule": ("flayer", {"lr_rule": False}, "base lr for every layer"),
    "no-masks": ("flayer", {"masks": False}, "every layer uploads everything"),
    "zero": ("flayer", {"server_rule": "zero"}, "Algorithm 1 literally: unsent = 0"),
    "flayer-ref": ("flayer-ref", {}, "the released code's rules"),
    "flayer-ref-x1": ("flayer-ref", {"lr_scale": 1.0}, "flayer-ref without its x20 LR factor"),
    "fedavg": ("fedavg", {}, "baseline (not in the default set)"),
}
DEFAULT_VARIANTS = ("flayer", "no-pla", "no-head-epoch", "no-lr-rule", "no-masks", "zero", "flayer-ref",
                    "flayer-ref-x1")
# the budget used when no --config is given: minutes on 2 CPU cores
DEFAULT_BUDGET = {"samples": 12000, "rounds": 25, "threads": 1}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ablate", help="FLAYER without each mechanism, rule zero and flayer-ref, "
                                      "on one partition, over one or more training seeds")
    add_common_flags(p)
    add_log_file_flag(p)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), metavar="A,B,...",
                   help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all but fedavg)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs in N processes at once (each with one torch thread unless --threads)")
    p.add_argument("--seeds", metavar="S1,S2,...",
                   help="training seeds (default: --seed alone); the partition follows --seed whatever the seeds")
    p.add_argument("--tuned", metavar="FILE", help="tuned.json from 'flayer tune': each variant runs at its "
                                                   "method's chosen learning rate (and options)")
    p.add_argument("--reuse", metavar="BENCH_DIR", help="a 'flayer bench' folder: a variant's run that is the one "
                                                        "the bench ran (same config and partition; flayer and "
                                                        "flayer-ref at the same rates) is copied, not run again")
    p.set_defaults(func=run)


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise CliError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                       f"choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def variant_config(cfg: Any, name: str, lr: float | None = None, sets: dict[str, Any] | None = None) -> Any:
    """The run config of one variant: its strategy, with its switches over the file's option table
    (and over ``sets``, a tuned choice's options), at ``lr`` when given."""
    strategy, overrides, _ = VARIANTS[name]
    options = {**cfg.options(strategy), **(sets or {}), **overrides}
    train = cfg.train if lr is None else dataclasses.replace(cfg.train, lr=lr)
    return dataclasses.replace(cfg, strategy=strategy, train=train,
                               strategy_options={**cfg.strategy_options, strategy: options})


def _run_variant(cfg: Any, name: str, folder: str, quiet: bool) -> dict[str, Any]:
    """One variant and seed, in this process or a worker (which loads the data itself)."""
    from cli.simulate import run_simulation

    set_threads(cfg)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    write_json(path / "config.json", dataclasses.asdict(cfg))
    return run_simulation(cfg, load_data(cfg), path, label=f"{name} seed{cfg.seed}", quiet=quiet)


def _with_budget(args: argparse.Namespace) -> argparse.Namespace:
    if args.config is None:
        for key, value in DEFAULT_BUDGET.items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    return args


def _tuned_points(args: argparse.Namespace, cfg: Any, names: list[str]) -> dict[str, tuple[float, dict[str, Any]]]:
    """Each variant's strategy -> (chosen learning rate, chosen options) from ``--tuned``; without it and
    without a learning rate in the flags or the config file, each method's default."""
    from cli.common import parse_set
    from cli.tuned import load_tuned

    if not args.tuned:
        from flayer.config import DEFAULT_LRS, read_toml

        explicit = args.lr is not None or (args.config and "lr" in read_toml(args.config).get("train", {}))
        # no learning rate given: each variant's method at its own default, not the first method's
        return {} if explicit else {VARIANTS[n][0]: (DEFAULT_LRS[VARIANTS[n][0]], {}) for n in names}
    if args.lr is not None:
        raise CliError("--tuned sets each variant's learning rate: drop --lr")
    strategies = list(dict.fromkeys(VARIANTS[n][0] for n in names))
    choice = load_tuned(Path(args.tuned), strategies, cfg)
    return {m: (c.lr, parse_set(list(c.sets)).get(m, {})) for m, c in choice.items()}


def _finished(path: Path, strategy: str, seed: int, rounds: int) -> dict[str, Any] | None:
    from cli.bench_report import finished_summary

    s = finished_summary(path / "summary.json", strategy, rounds)
    return s if s is not None and s.get("seed") == seed else None


def _ms(xs: list[float], pct: bool = True) -> str:
    k = 100 if pct else 1
    m = f"{k * mean(xs):.2f}" if pct else f"{mean(xs):.4f}"
    return m + (f" ± {k * stdev(xs):.2f}" if pct and len(xs) > 1 else "")


def run(args: argparse.Namespace) -> int:
    from cli.bench import _int_list, check_settings
    from cli.plots import line_plot

    names = parse_variants(args.variants)
    if args.jobs < 1:
        raise CliError(f"--jobs must be >= 1, got {args.jobs}")
    cfg = run_config(_with_budget(args))
    seeds = [cfg.seed] if args.seeds is None else _int_list(args.seeds, "seeds")
    tuned = _tuned_points(args, cfg, names)
    # the partition stays the one --seed draws; the seeds vary the training
    base = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, partition_seed=cfg.partition_seed))
    configs = {}
    for s in seeds:  # seed by seed: an ablation stopped early has whole seeds, every variant in each
        for n in names:
            lr, sets = tuned.get(VARIANTS[n][0], (None, None))
            configs[n, s] = dataclasses.replace(variant_config(base, n, lr, sets), seed=s)
    out = Path(cfg.out) if cfg.out else Path("runs") / f"ablate-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("seed", "out", "strategy",
                                                                                "strategy_options")}
    settings["tuned"] = {m: [lr, sets] for m, (lr, sets) in tuned.items()}
    if tuned:  # every variant's rate is its method's, recorded under "tuned": the base rate plays no part
        settings["train"] = {**settings["train"], "lr": None}
    write_json(out / "ablate.json", check_settings(out / "ablate.json", settings, "an ablation"))
    write_json(out / "config.json", dataclasses.asdict(cfg))
    samples = load_data(cfg).partition.summary.get("samples")  # fails fast on bad data, before any worker
    t0 = time.perf_counter()
    folder = {(n, s): out / n / f"seed{s}" for n in names for s in seeds}
    summaries: dict[tuple[str, int], dict[str, Any]] = {}
    for key, c in configs.items():
        if (done := _finished(folder[key], c.strategy, key[1], cfg.rounds)) is not None:
            summaries[key] = done
    if args.reuse:
        reused = reuse_bench_runs(Path(args.reuse), configs, folder, load_data(cfg).partition, cfg.rounds)
        for key in reused:
            summaries[key] = _finished(folder[key], configs[key].strategy, key[1], cfg.rounds) or {}
        print(f"flayer ablate: {len(reused)} run(s) taken from {args.reuse} "
              f"({', '.join(f'{n} seed{s}' for n, s in reused) or 'none matched'})", file=sys.stderr)
    todo = [k for k in configs if k not in summaries]
    print(f"flayer ablate: {len(names)} variants x {len(seeds)} seeds = {len(configs)} runs; "
          f"{len(summaries)} already done in {out}, {len(todo)} to run", file=sys.stderr)
    jobs = min(args.jobs, max(1, len(todo)))
    if jobs == 1:
        for k in todo:
            summaries[k] = _run_variant(configs[k], k[0], str(folder[k]), quiet=False)
    else:
        if cfg.train.threads == 0:
            configs = {k: dataclasses.replace(c, train=dataclasses.replace(c.train, threads=1))
                       for k, c in configs.items()}
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_run_variant, configs[k], k[0], str(folder[k]), True): k for k in todo}
            print(f"running {len(todo)} runs in {jobs} processes...", file=sys.stderr)
            for i, fut in enumerate(as_completed(futures), 1):
                k = futures[fut]
                summaries[k] = fut.result()
                print(f"  [{i}/{len(todo)}] {k[0]} seed{k[1]}: best acc {summaries[k]['best_acc']:.4f} "
                      f"({summaries[k]['wall_seconds']:.0f}s)", file=sys.stderr)
    per = {n: [summaries[n, s] for s in seeds] for n in names}
    headers = ["variant", "changes", "lr", "final-round acc %", "best acc %", "personal acc %",
               "upload fraction", "unsent", "CPU s"]
    rows = [(n, VARIANTS[n][2], f"{configs[n, seeds[0]].train.lr:g}",
             _ms([x["final_round_acc"] for x in v]), _ms([x["best_acc"] for x in v]),
             _ms([x["final_personal_acc"] for x in v]), _ms([x["mean_upload_fraction"] for x in v], False),
             _ms([x["mean_unsent_fraction"] for x in v], False),
             round(sum(x.get("cpu_seconds", math.nan) for x in v))) for n, v in per.items()]
    s0 = per[names[0]][0]
    title = (f"{cfg.data.dataset} {s0['partition']}, {s0['clients']} clients, {cfg.rounds} rounds, "
             f"partition seed {cfg.seed}, training seeds {','.join(map(str, seeds))}"
             + (f", {samples} samples" if samples else "") + (", tuned learning rates" if args.tuned else ""))
    argv = sys.argv[1:]
    command = "flayer " + " ".join(argv) if argv and argv[0] == "ablate" else "flayer ablate"
    md = (f"# FLAYER ablation: {title}\n\n`{command}`\n\n" + table(headers, rows, markdown=True) + "\n\n"
          "Accuracies in %, mean ± std over the training seeds. final-round acc: mean test accuracy "
          "(sample-weighted over all clients) after the download and PLA, before local training, in the last "
          "round; best acc: the best such round or the final personal models; personal acc: every client's "
          "personal model after the last round; upload fraction: coordinates sent / coordinates of the "
          "uploaded tensors, mean over rounds; unsent: share of the global model's coordinates that no client "
          "sent in a round (rule zero sets them to 0, rule carry keeps them), mean over rounds; CPU s: the "
          "runs' CPU time, summed over seeds.\n")
    (out / "ablation.md").write_text(md)
    write_json(out / "summary.json", {"title": title, "command": command, "seeds": seeds,
                                      "variants": {n: {f"seed{s}": summaries[n, s] for s in seeds} for n in names}})
    curves = {}
    for n, v in per.items():
        length = min(len(x["acc"]) for x in v)
        curves[n] = [mean(x["acc"][i] for x in v) for i in range(length)]
    line_plot(out / "accuracy.png", curves, "round", "test accuracy (mean over seeds)", f"FLAYER ablation: {title}")
    print(table(headers, rows))
    print(f"\n{title}; {time.perf_counter() - t0:.0f}s in all")
    print(f"outputs in {out}/ (ablation.md, accuracy.png, summary.json, <variant>/seed<S>/metrics.jsonl)",
          file=sys.stderr)
    return 0


# what differs between a bench's run of a config and the same run here: where it is written, how the
# partition reaches it (a saved file there, drawn here: the arrays are compared instead), how many threads
_NOT_COMPARED = {("out",), ("data", "partition_file"), ("data", "partition"), ("data", "samples"),
                 ("data", "partition_seed"), ("train", "device"), ("train", "threads")}


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    from flayer.train import pick_device

    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    for path in _NOT_COMPARED:
        holder = out
        for key in path[:-1]:
            holder = holder.get(key, {}) if isinstance(holder, dict) else {}
        if isinstance(holder, dict):
            holder.pop(path[-1], None)
    out["strategy_options"] = (config.get("strategy_options") or {}).get(config.get("strategy")) or {}  # its own
    device = (config.get("train") or {}).get("device", "auto")
    try:
        out["device"] = str(pick_device(device))  # auto and cpu are one device on a machine without a GPU
    except (RuntimeError, ValueError):
        out["device"] = device
    return out


def reuse_bench_runs(bench: Path, configs: dict[tuple[str, int], Any], folder: dict[tuple[str, int], Path],
                     partition: Any, rounds: int) -> list[tuple[str, int]]:
    """Copy ``bench/runs/<strategy>/seed<s>`` into ``folder[(variant, s)]`` for each variant and seed not
    finished here whose run there is finished, did not diverge, ran this very config (:func:`_comparable`)
    and read the same partition arrays. Returns the (variant, seed) pairs copied."""
    import json
    import shutil
    import tempfile
    import zipfile

    from cli.bench import _same_arrays
    from cli.bench_report import load_run
    from flayer.partition import save_partition

    if not (bench / "bench.json").is_file():
        raise CliError(f"--reuse {bench}: no bench.json there; give a 'flayer bench --out' folder")
    with tempfile.TemporaryDirectory() as tmp:
        mine = save_partition(partition, Path(tmp) / "partition.npz")
        try:
            if not _same_arrays(bench / "partition.npz", mine):
                return []
        except (OSError, ValueError, zipfile.BadZipFile):
            return []
    copied = []
    for key, c in configs.items():
        src, dst = bench / "runs" / c.strategy / f"seed{key[1]}", folder[key]
        if _finished(dst, c.strategy, key[1], rounds) is not None:
            continue
        run = load_run(src / "summary.json", c.strategy, key[1], rounds)
        try:
            theirs = json.loads((src / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if run is None or run.diverged or _comparable(theirs) != _comparable(dataclasses.asdict(c)):
            continue
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        copied.append(key)
    return copied
