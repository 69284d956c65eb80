"""``flayer simulate``: an in-process federation with the same strategy code as over MQTT."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

from cli.common import (
    CliError,
    Prepared,
    add_common_flags,
    load_data,
    out_dir,
    run_config,
    set_threads,
    write_json,
)
from cli.logfile import add_log_file_flag
from cli.privacy import add_privacy_flags, plan_text
from cli.progress import Progress
from cli.report import table
from cli.tensorboard import TensorBoardSink, add_tensorboard_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run a federation in one process and report accuracy per round")
    add_common_flags(p)
    add_log_file_flag(p)
    add_tensorboard_flag(p)
    p.add_argument("--save-models", action="store_true",
                   help="write the final global model and every client's personal model (safetensors) "
                        "under OUT/models/, for 'flayer export'")
    p.add_argument("--runtime", choices=("torch", "executorch"), default="torch",
                   help="where the local SGD runs: torch (default) or the model's ExecuTorch training program "
                        "(CPU; cnn and fasttext; needs the 'executorch' extra)")
    p.add_argument("--blowup", type=float, default=None, metavar="FACTOR",
                   help="stop the run as diverged when the mean training loss exceeds FACTOR x ln(classes), the "
                        "loss of a uniform guess (a non-finite loss or model always stops it); default: off")
    add_thin_flags(p)
    add_privacy_flags(p)
    p.add_argument("--secure-drop", type=float, default=0.0, metavar="P",
                   help="secure rounds: each selected device drops out at a random protocol step with "
                        "probability P (planning a fleet's dropouts; default 0)")
    p.add_argument("--dp-seeded-noise", action="store_true",
                   help="draw the privacy noise from --seed instead of the operating system's CSPRNG: a "
                        "reproducible run that is NOT private (anyone who knows the seed subtracts the noise)")
    p.add_argument("--clip-only", type=float, default=None, metavar="C",
                   help="measurement, NOT private (no noise, no epsilon): the uploads of a private round clipped to "
                        "norm C, averaged as --clip-average says; for what the clip costs (docs/results/privacy.md)")
    p.add_argument("--clip-average", choices=("weighted", "fixed"), default="fixed",
                   help="--clip-only: sum over the fixed denominator m as private rounds do (fixed), or the "
                        "strategy's sample-weighted average (weighted)")
    p.set_defaults(func=run)


def add_thin_flags(p: argparse.ArgumentParser) -> None:
    """Thin links (emulator.thinsim): how uploads and downloads are coded, and their bytes counted."""
    from protocol import VALUE_CODECS
    from protocol.model_delta import DELTA_MODES

    g = p.add_argument_group("thin links (what devices send and receive; see docs/howto/thin-links.md)")
    g.add_argument("--value-codec", choices=tuple(VALUE_CODECS), default="fp32",
                   help="code the uploaded values with this codec; the server folds them as decoded (fp32)")
    g.add_argument("--keep", type=float, default=1.0, metavar="SHARE",
                   help="upload only the largest SHARE (0-1] of each tensor's masked coordinates (1)")
    g.add_argument("--error-feedback", action="store_true",
                   help="keep what the codec and --keep left out per client and add it to its next update")
    g.add_argument("--delta-downloads", choices=DELTA_MODES, default="off",
                   help="a client holding the previous model receives the delta to the new one (off)")
    g.add_argument("--zstd", action="store_true", help="zstd on the uploads")


def thin_options(args: argparse.Namespace) -> Any:
    """The :class:`emulator.thinsim.ThinOptions` of the flags (CliError when out of range)."""
    from emulator.thinsim import ThinOptions

    try:
        return ThinOptions(args.value_codec, args.keep, args.error_feedback, args.delta_downloads, args.zstd)
    except ValueError as exc:
        raise CliError(f"--keep / --value-codec / --delta-downloads: {exc}") from None


def check_blowup(factor: float) -> None:
    """``--blowup``: a finite factor above 1 (CliError otherwise)."""
    if not (math.isfinite(factor) and factor > 1):
        raise CliError(f"--blowup must be a finite factor above 1, got {factor}")


def training_runtime(runtime: str, strategy: Any, device: Any) -> Any:
    """The :class:`flayer.train.TrainingEngine` for ``runtime`` (None for torch); CliError when the
    strategy, model or device cannot use it."""
    if runtime == "torch":
        return None
    if runtime != "executorch":
        raise CliError(f"unknown runtime {runtime!r}: torch or executorch")
    from export.deps import MissingDependency
    from export.et_engine import ExecuTorchEngine, UnsupportedTraining, check_strategy

    if device.type != "cpu":
        raise CliError(f"runtime executorch runs on the CPU; the run asks for device {device} (use --device cpu)")
    try:
        check_strategy(strategy.name, strategy.spec)
        return ExecuTorchEngine(strategy.spec)
    except (UnsupportedTraining, MissingDependency) as exc:
        raise CliError(str(exc)) from exc


def check_privacy(cfg: Any, strategy: Any, population: int) -> None:
    """CliError naming what a private run cannot honour (the strategy's options, delta >= 1/N, ...)."""
    if cfg.privacy.schema.active and not cfg.privacy.enabled:
        raise CliError("[privacy]: max_participations / min_separation bound a private federation's epsilon; "
                       "they need --dp (or [privacy] enabled)")
    if not (cfg.privacy.enabled or cfg.privacy.secure_aggregation):
        return
    from flayer.engine import select_clients
    from flayer.engine.privacy import private_strategy

    try:
        private_strategy(strategy)
        if not cfg.privacy.enabled:
            return
        s = cfg.privacy.resolve(population, len(select_clients(population, cfg.join_ratio, cfg.seed, 1)))
    except ValueError as exc:
        raise CliError(f"[privacy]: {exc}") from None
    from flayer.engine.accountant import epsilon_for

    eps = epsilon_for([(s.noise_multiplier, 1.0, cfg.rounds)], s.delta, s.max_participations)
    for line in s.warnings(eps, cfg.rounds) if math.isfinite(eps) else []:
        print(f"warning: privacy: {line}", file=sys.stderr)


def simulate_round_record(rec: Any, now: float) -> dict[str, Any]:
    """A :class:`flayer.simulation.RoundRecord` as a ``round`` record of the metrics schema: every selected
    client reports (ids are client indices); bytes down: the model or delta blob each selected client received
    (``flayer simulate``, :mod:`emulator.thinsim`), or without link hooks a dense fp32 model per selected client."""
    from protocol.metrics_schema import round_record

    selected = [str(c) for c in rec.selected]
    extra = {k: v for k, v in rec.as_dict().items() if k not in ("round", "selected", "acc", "train_loss")}
    rows = [{"id": str(c), "result": "accepted", "acc": rec.client_acc[c] if c < len(rec.client_acc) else None}
            for c in rec.selected]
    return round_record("simulate", now, round=rec.round, wall_s=rec.seconds, selected=selected, devices=rows,
                        refused={}, bytes_up=rec.upload_bytes,
                        bytes_down=rec.download_bytes or 4 * rec.coordinates * len(selected),
                        acc=rec.acc, train_loss=rec.train_loss if math.isfinite(rec.train_loss) else None,
                        closed="all", **extra)


def run_simulation(cfg: Any, prepared: Prepared, out: Path, label: str | None = None,
                   quiet: bool = False, save_models: bool = False, runtime: str = "torch",
                   blowup: float | None = None, thin: Any = None, secure_drop: float = 0.0,
                   seeded_noise: bool = False, clip_only: tuple[float, str] | None = None) -> dict[str, Any]:
    """Run one simulation, writing metrics.jsonl and summary.json under ``out``; returns the summary.
    ``thin``: :class:`emulator.thinsim.ThinOptions` (what the links carry, both ways counted; None: no link hooks,
    the updates folded as trained and sized as fp32 blobs)."""
    from flayer.engine import initial_global_state
    from flayer.engine.secure import abandon_kind
    from flayer.simulation import simulate
    from flayer.strategies import make_strategy
    from flayer.train import client_data, pick_device, training_engine
    from protocol import update_sizer
    from protocol.metrics_schema import MetricsFile, end_record, epsilon_value, run_record

    try:
        device = pick_device(cfg.train.device)
        spec = prepared.dataset.model_spec(cfg.data.model)
        strategy = make_strategy(cfg.strategy, spec, cfg.train, cfg.options()).keep_blank()
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if blowup is not None:
        check_blowup(blowup)
    engine = training_runtime(runtime, strategy, device)
    private = cfg.privacy.enabled or cfg.privacy.secure_aggregation
    if cfg.privacy.enabled and thin is not None and thin.value_codec != "fp32":
        raise CliError(f"[privacy]: --value-codec {thin.value_codec}: a lossy codec moves an honest device's clipped "
                       f"upload past C, and the count of updates clipped again would say whose; use fp32")
    if private and thin is not None and (thin.keep < 1 or thin.error_feedback):
        raise CliError("[privacy]: --keep < 1 and --error-feedback choose what a device sends from its own update "
                       "(its largest values, its residual); private rounds cannot honour them")
    clients = [client_data(prepared.dataset, c) for c in prepared.partition.clients]
    check_privacy(cfg, strategy, len(clients))
    if clip_only is not None and (cfg.privacy.enabled or not (math.isfinite(clip_only[0]) and 1e-6 <= clip_only[0] <= 1e6)):
        raise CliError(f"--clip-only {clip_only[0]}: a finite C in [1e-6, 1e6], and no --dp (it measures the clip "
                       f"without noise)")
    metrics = MetricsFile(out / "metrics.jsonl", "w")
    metrics.write(run_record("simulate", time.time(), cfg.strategy, cfg.rounds, len(clients),
                             dataset=cfg.data.dataset, seed=cfg.seed))
    progress = None if quiet else Progress(cfg.rounds * len(clients), label or f"{cfg.strategy}")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        def on_round(rec: Any) -> None:
            metrics.write(simulate_round_record(rec, time.time()))
            if progress is not None:
                progress.note = f"round {rec.round}: acc {rec.acc:.4f}"

        def on_client(r: int, done: int) -> None:
            if progress is not None:
                progress.update((r - 1) * len(clients) + done)

        links, g0 = None, None
        if thin is not None:
            from emulator.thinsim import link_hooks

            g0 = initial_global_state(strategy, cfg.seed)
            links = link_hooks(thin, g0)
        with training_engine(engine):
            result = simulate(strategy, clients, cfg.rounds, cfg.seed, cfg.join_ratio, device, global_state=g0,
                              on_round=on_round, on_client=on_client, sizer=update_sizer(), val=True,
                              blowup=blowup, links=links, privacy=cfg.privacy, secure_drop=secure_drop,
                              seeded_noise=seeded_noise, clip_only=clip_only)
        if not result.rounds:
            raise CliError(result.budget_stop or "no round ran")
        metrics.write(end_record("simulate", time.time(), len(result.rounds), result.diverged is None,
                                 result.rounds[-1].acc, final_personal_acc=result.final_acc,
                                 final_client_acc=result.final_client_acc, diverged=result.diverged,
                                 epsilon=epsilon_value(result.epsilon), delta=result.delta, budget_stop=result.budget_stop))
    finally:
        metrics.close()
    if progress is not None:
        progress.close()
    if save_models:
        with training_engine(engine):
            _save_models(strategy.with_options(result.calibration), result, clients, cfg, out / "models", device)
    summary = {
        "strategy": cfg.strategy, "dataset": cfg.data.dataset, "partition": prepared.partition.summary["partition"],
        "clients": prepared.partition.num_clients, "rounds": cfg.rounds, "seed": cfg.seed,
        "final_round_acc": result.rounds[-1].acc, "best_acc": result.best_acc, "final_personal_acc": result.final_acc,
        "mean_upload_fraction": sum(r.upload_fraction for r in result.rounds) / len(result.rounds),
        "mean_unsent_fraction": sum(r.unsent_fraction for r in result.rounds) / len(result.rounds),
        "runtime": runtime, "runtime_steps": getattr(engine, "steps", None),
        "wall_seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
        "acc": [r.acc for r in result.rounds], "final_client_acc": result.final_client_acc,
        "val_acc": [r.val_acc for r in result.rounds],
        "final_personal_val_acc": result.final_val_acc, "best_val_acc": result.best_val_acc,
        "diverged": result.diverged,
        "calibration": result.calibration,
        "uploads": sum(len(r.selected) for r in result.rounds),
        "sent_total": sum(r.sent for r in result.rounds),
        "indexed_total": sum(r.indexed for r in result.rounds),
        "upload_bytes_total": sum(r.upload_bytes for r in result.rounds),
        "download_bytes_total": sum(r.download_bytes for r in result.rounds) if links is not None else None,
        "thin": dataclasses.asdict(thin) if thin is not None else None,
        "privacy": dataclasses.asdict(cfg.privacy) if private else None,
        "secure_dropped_total": sum(r.dropped for r in result.rounds),
        "secure_abandoned_rounds": sum(r.abandoned is not None for r in result.rounds),
        "dp_rounds": sum(r.abandoned is None or abandon_kind(r.abandoned) == "sum_check" for r in result.rounds),
        "epsilon": epsilon_value(result.epsilon), "delta": result.delta, "budget_stop": result.budget_stop,
        "epsilon_coordinator": epsilon_value(result.epsilon_coordinator),
        "clip_only": list(clip_only) if clip_only is not None else None,
        "server_step": list(result.server_step) if result.server_step is not None else None,
        "dp_noise": None if not private else "seeded: not private" if seeded_noise else "csprng",
    }
    write_json(out / "summary.json", summary)
    return summary


def _save_models(strategy: Any, result: Any, clients: list, cfg: Any, folder: Path, device: Any) -> None:
    from flayer.state import save_model
    from flayer.strategies.base import RoundContext
    from flayer.update import float_state

    meta = {"strategy": cfg.strategy, "dataset": cfg.data.dataset, "rounds": cfg.rounds, "seed": cfg.seed}
    save_model(folder / "global.safetensors", result.global_state, strategy.spec, {**meta, "role": "global"})
    for i, data in enumerate(clients):
        ctx = RoundContext(round=cfg.rounds + 1, client=i, seed=cfg.seed, device=device)
        model = strategy.personal_model(result.global_state, result.states[i], data, ctx)
        save_model(folder / f"client_{i:03d}.safetensors", float_state(model), strategy.spec,
                   {**meta, "role": "personal", "client": i})


def run(args: argparse.Namespace) -> int:
    from cli.plots import bar_plot, line_plot

    cfg = run_config(args)
    if args.dp_plan:
        from flayer.engine import select_clients

        asked = len(select_clients(cfg.data.clients, cfg.join_ratio, cfg.seed, 1))
        print(plan_text(cfg.privacy, cfg.data.clients, asked, cfg.rounds))
        return 0
    thin = thin_options(args)
    set_threads(cfg)
    prepared = load_data(cfg)
    out = out_dir(cfg, "simulate")
    write_json(out / "config.json", dataclasses.asdict(cfg))
    write_json(out / "partition.json", prepared.partition.summary)
    s = run_simulation(cfg, prepared, out, save_models=args.save_models, runtime=args.runtime,
                       blowup=args.blowup, thin=thin, secure_drop=args.secure_drop,
                       seeded_noise=args.dp_seeded_noise,
                       clip_only=None if args.clip_only is None else (args.clip_only, args.clip_average))
    if args.tensorboard:
        TensorBoardSink(args.tensorboard, out / "metrics.jsonl").close()
    rows = [(i + 1, a, "-" if v is None else v) for i, (a, v) in enumerate(zip(s["acc"], s["val_acc"]))]
    print(table(["round", "test acc", "val acc"], rows))
    if s["diverged"]:
        print(f"\nstopped after round {len(s['acc'])} of {cfg.rounds}: {s['diverged']}")
    if s["budget_stop"]:
        print(f"\n{s['budget_stop']}")
    if s["dp_noise"] == "seeded: not private":
        print(f"\nNOT PRIVATE: --dp-seeded-noise drew the noise from seed {cfg.seed}; anyone who knows it regenerates "
              f"the noise and subtracts it, so the epsilon below describes the noise's scale, not a guarantee")
    if s["epsilon"] is not None:  # a number, or "inf" without noise
        from cli.privacy import epsilon_lines

        print("\n" + epsilon_lines(s, len(s["acc"])) + f"\n({cfg.privacy.mode} noise, z {cfg.privacy.noise_multiplier:g}, "
              f"C {cfg.privacy.clip:g})")
    if cfg.privacy.secure_aggregation:
        print(f"\nsecure aggregation: the coordinator saw only each round's sum; {s['secure_dropped_total']} "
              f"device(s) dropped out of the protocol, {s['secure_abandoned_rounds']} round(s) abandoned")
    print(f"\n{cfg.strategy} on {cfg.data.dataset} {s['partition']}, {s['clients']} clients, {cfg.rounds} rounds: "
          f"final-round acc {s['final_round_acc']:.4f}, best {s['best_acc']:.4f}, personal models after the "
          f"last round {s['final_personal_acc']:.4f}, upload fraction {s['mean_upload_fraction']:.3f}, "
          f"{s['wall_seconds']:.0f}s" + (f"; calibration chose {s['calibration']}" if s["calibration"] else "")
          + (f"; {s['runtime_steps']} SGD steps through ExecuTorch" if s["runtime"] == "executorch" else ""))
    line_plot(out / "accuracy.png", {cfg.strategy: s["acc"]}, "round", "test accuracy",
              f"{cfg.strategy} on {cfg.data.dataset} {s['partition']}")
    bar_plot(out / "client_accuracy.png", [str(i) for i in range(len(s["final_client_acc"]))], s["final_client_acc"],
             "test accuracy", "personal model accuracy per client after the last round")
    print(f"outputs in {out}/ (metrics.jsonl, summary.json, accuracy.png, client_accuracy.png)", file=sys.stderr)
    return 0
