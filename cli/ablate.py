"""``flayer ablate``: FLAYER with each mechanism switched off in turn, the literal server rule, and the
released code's preset, on one partition and seed; a table and an accuracy-vs-round plot.

The ``zero`` row measures the published review's objection (Algorithm 1 read literally zeroes
every coordinate no client uploads) instead of arguing about it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
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
    "fedavg": ("fedavg", {}, "baseline (not in the default set)"),
}
DEFAULT_VARIANTS = ("flayer", "no-pla", "no-head-epoch", "no-lr-rule", "no-masks", "zero", "flayer-ref")
# the budget used when no --config is given: minutes on 2 CPU cores
DEFAULT_BUDGET = {"samples": 12000, "rounds": 25, "threads": 1}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ablate", help="FLAYER without each mechanism, rule zero and flayer-ref, "
                                      "on one partition and seed")
    add_common_flags(p)
    add_log_file_flag(p)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), metavar="A,B,...",
                   help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all but fedavg)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="variants run in N processes at once (each with one torch thread unless --threads)")
    p.set_defaults(func=run)


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise CliError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                       f"choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def variant_config(cfg: Any, name: str) -> Any:
    """The run config of one variant: its strategy, with its switches over the file's option table."""
    strategy, overrides, _ = VARIANTS[name]
    options = {**cfg.options(strategy), **overrides}
    return dataclasses.replace(cfg, strategy=strategy,
                               strategy_options={**cfg.strategy_options, strategy: options})


def _run_variant(cfg: Any, name: str, folder: str, quiet: bool) -> dict[str, Any]:
    """One variant, in this process or a worker (which loads the data itself)."""
    from cli.simulate import run_simulation

    set_threads(cfg)
    path = Path(folder) / name
    path.mkdir(parents=True, exist_ok=True)
    write_json(path / "config.json", dataclasses.asdict(cfg))
    return run_simulation(cfg, load_data(cfg), path, label=name, quiet=quiet)


def _with_budget(args: argparse.Namespace) -> argparse.Namespace:
    if args.config is None:
        for key, value in DEFAULT_BUDGET.items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    return args


def run(args: argparse.Namespace) -> int:
    from cli.plots import line_plot

    names = parse_variants(args.variants)
    if args.jobs < 1:
        raise CliError(f"--jobs must be >= 1, got {args.jobs}")
    cfg = run_config(_with_budget(args))
    configs = {n: variant_config(cfg, n) for n in names}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.out) if cfg.out else Path("runs") / f"ablate-{cfg.data.dataset}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", dataclasses.asdict(cfg))
    samples = load_data(cfg).partition.summary.get("samples")  # fails fast on bad data, before any worker
    t0 = time.perf_counter()
    summaries: dict[str, dict[str, Any]] = {}
    jobs = min(args.jobs, len(names))
    if jobs == 1:
        for n in names:
            summaries[n] = _run_variant(configs[n], n, str(out), quiet=False)
    else:
        if cfg.train.threads == 0:
            configs = {n: dataclasses.replace(c, train=dataclasses.replace(c.train, threads=1))
                       for n, c in configs.items()}
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_run_variant, configs[n], n, str(out), True): n for n in names}
            print(f"running {len(names)} variants in {jobs} processes...", file=sys.stderr)
            for fut in as_completed(futures):
                n = futures[fut]
                summaries[n] = fut.result()
                print(f"  {n}: best acc {summaries[n]['best_acc']:.4f} ({summaries[n]['wall_seconds']:.0f}s)",
                      file=sys.stderr)
    summaries = {n: summaries[n] for n in names}  # the order asked for, not the order of completion
    headers = ["variant", "changes", "final-round acc", "best acc", "personal acc", "upload fraction",
               "unsent", "seconds"]
    rows = [(n, VARIANTS[n][2], s["final_round_acc"], s["best_acc"], s["final_personal_acc"],
             s["mean_upload_fraction"], s["mean_unsent_fraction"], round(s["wall_seconds"]))
            for n, s in summaries.items()]
    s0 = summaries[names[0]]
    title = (f"{cfg.data.dataset} {s0['partition']}, {s0['clients']} clients, {cfg.rounds} rounds, "
             f"seed {cfg.seed}"
             + (f", {samples} samples" if samples else ""))
    argv = sys.argv[1:]
    command = "flayer " + " ".join(argv) if argv and argv[0] == "ablate" else "flayer ablate"
    md = (f"# FLAYER ablation: {title}\n\n`{command}`\n\n" + table(headers, rows, markdown=True) + "\n\n"
          "final-round acc: mean test accuracy (sample-weighted over all clients) after the download and "
          "PLA, before local training, in the last round; best acc: the best such round or the final "
          "personal models; personal acc: every client's personal model after the last round; upload "
          "fraction: coordinates sent / coordinates of the uploaded tensors, mean over rounds; unsent: "
          "share of the global model's coordinates that no client sent in a round (rule zero sets them "
          "to 0, rule carry keeps them), mean over rounds.\n")
    (out / "ablation.md").write_text(md)
    write_json(out / "summary.json", {"title": title, "command": command, "variants": summaries})
    line_plot(out / "accuracy.png", {n: summaries[n]["acc"] for n in names}, "round", "test accuracy",
              f"FLAYER ablation: {title}")
    print(table(headers, rows))
    print(f"\n{title}; {time.perf_counter() - t0:.0f}s in all")
    print(f"outputs in {out}/ (ablation.md, accuracy.png, summary.json, <variant>/metrics.jsonl)",
          file=sys.stderr)
    return 0
