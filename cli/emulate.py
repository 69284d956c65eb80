"""``flayer emulate``: a whole fleet on this machine -- broker, coordinator and N edge clients with
device profiles -- running the same code real devices run.

Shows each round as it closes (devices reported of selected, devices online, MB up and down over the
emulated links, accuracy), device crashes as they happen, then a table per round and per profile,
and writes metrics.jsonl (the metrics schema, as the run goes), rounds.jsonl, devices.jsonl,
summary.json and PNG plots under the output folder it names at the end; ``--dashboard`` serves the live
dashboard meanwhile and prints its address. A flag that the chosen mode does not use is refused with
a message naming the mode it needs (:func:`check_mode_flags`): ``--budget`` and ``--sample-cost`` need
``--virtual``; the fleet's processes, broker, dashboard and wall-clock flags have no meaning with it.
Exit status 0 when every round ran; 2 for a configuration error (or a refused flag); 1 when a process of the fleet failed (its log is shown); 130 after Ctrl-C (everything it started
is stopped).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cli.common import CliError, add_common_flags, add_mode_flags, mode_overrides, port_arg
from cli.emulate_show import DASHBOARD_DEFAULT, Dashboard, Display, device_plots, privacy_line, secure_line
from cli.logfile import add_log_file_flag
from cli.privacy import add_privacy_flags, privacy_overrides
from cli.tensorboard import TensorBoardSink, add_tensorboard_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("emulate", help="run an emulated fleet of edge devices over a real broker",
                       description=__doc__.splitlines()[0])
    add_common_flags(p)
    add_log_file_flag(p)
    add_tensorboard_flag(p)
    add_privacy_flags(p)
    v = p.add_argument_group("simulated clock (--virtual: the fleet in one process, no broker, in seconds)")
    v.add_argument("--virtual", action="store_true",
                   help="run the fleet on a simulated clock: the round engine, the profiles and their "
                        "availability, the real local rounds; only time is simulated")
    v.add_argument("--budget", type=float, metavar="SECONDS",
                   help="simulated seconds the run may take (default: until --rounds versions)")
    v.add_argument("--sample-cost", type=float, metavar="SECONDS",
                   help="compute seconds per training sample at slowdown 1 (default: the CPU time each local "
                        "round took here; give one for runs that repeat exactly)")
    g = p.add_argument_group("fleet (flags override the config's [emulator], [federation] and [edge] tables)")
    g.add_argument("--profiles", metavar="FILE.toml", help="device profiles and [mix] (built-ins without it)")
    g.add_argument("--mix", metavar="NAME=SHARE,...",
                   help="share of the fleet per profile, e.g. laptop=0.5,phone-4g=0.5")
    g.add_argument("--trace", metavar="FILE.csv",
                   help="availability trace: device_id,start_s,end_s online intervals")
    g.add_argument("--trace-scale", type=float, metavar="X", help="trace seconds per second of the run")
    g.add_argument("--workers", type=int, metavar="W",
                   help="processes hosting the devices (default: one per core)")
    g.add_argument("--network", choices=("auto", "thread", "shared"),
                   help="a paho thread per device, or one shared network thread per worker (auto: shared "
                        "above "
                        "250 devices per worker)")
    g.add_argument("--model-slots", type=int, metavar="N",
                   help="devices per worker holding a model at once, in the rounds and the final save (an idle "
                        "device holds none; default 16, 0 = no bound)")
    g.add_argument("--shard", metavar="i/n", default="0/1",
                   help="host devices k with k %% n == i (shard 0 runs the broker and the coordinator)")
    g.add_argument("--broker", metavar="mqtt://HOST:PORT",
                   help="connect to this broker (with --broker-state)")
    g.add_argument("--broker-state", metavar="DIR",
                   help="state folder of a running broker: credentials are there")
    g.add_argument("--broker-kind", choices=("auto", "mosquitto", "embedded"),
                   help="the broker the emulator starts (auto: mosquitto when installed)")
    g.add_argument("--federation", metavar="NAME", help="federation name on the broker (default emu)")
    g.add_argument("--quorum", type=int, metavar="N",
                   help="updates that close a round (default: half the fleet)")
    g.add_argument("--over-selection", type=float, metavar="F",
                   help="select ceil(F x quorum) online devices (1.3)")
    g.add_argument("--min-devices", type=int, metavar="N",
                   help="devices online before a round starts (quorum)")
    g.add_argument("--deadline", type=float, metavar="SECONDS", help="a round closes at its deadline (120)")
    g.add_argument("--grace", type=float, metavar="SECONDS",
                   help="after the quorum, stragglers get this long (3)")
    add_mode_flags(g)
    g.add_argument("--heartbeat", type=float, metavar="SECONDS", help="devices' status interval (5)")
    g.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="give up after this long (default: never)")
    from protocol import VALUE_CODECS
    from protocol.model_delta import DELTA_MODES

    g.add_argument("--value-codec", choices=tuple(VALUE_CODECS),
                   help="the codec devices upload with (the plan's; fp32)")
    g.add_argument("--delta-downloads", choices=DELTA_MODES,
                   help="publish the change from the previous model too; devices holding it fetch only that (off)")
    g.add_argument("--http-models", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the global model and its deltas over HTTP: nginx on the coordinator's models "
                        "folder, devices fetch from it instead of the broker's chunks ([emulator] http_models)")
    g.add_argument("--upload", choices=("plan", "fit"),
                   help="plan: devices upload with the plan's codec; fit: codec and top-k share fitted to each "
                        "device's uplink and the round's expected close (plan)")
    g.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="devices keep what their upload left out and add it to their next update "
                        "(--no-error-feedback: they do not; default: the config's [edge] error_feedback)")
    g.add_argument("--dashboard", nargs="?", const=DASHBOARD_DEFAULT, metavar="HOST:PORT",
                   help=f"serve the live dashboard while the fleet runs and print its address ({DASHBOARD_DEFAULT}, "
                        f"or a free port when that one is taken; see 'flayer dashboard')")
    g.add_argument("--metrics-port", type=port_arg, metavar="PORT",
                   help="the coordinator serves Prometheus metrics on 127.0.0.1:PORT/metrics ([federation] "
                        "metrics_port; docs/reference/metrics.md)")
    p.set_defaults(func=run)


# flags of the real fleet that --virtual (one process, no broker, a simulated clock) has no use for
NOT_VIRTUAL = {
    "workers": "there are no worker processes on the simulated clock",
    "network": "there are no network threads on the simulated clock",
    "model_slots": "the simulated fleet runs no edge clients to bound",
    "shard": "the simulated fleet runs in one process",
    "broker": "the simulated fleet has no broker", "broker_state": "the simulated fleet has no broker",
    "broker_kind": "the simulated fleet has no broker", "federation": "the simulated fleet has no broker",
    "dashboard": "the dashboard watches a broker; read the run's rounds.jsonl and summary.json",
    "metrics_port": "the simulated fleet has no coordinator process to scrape",
    "tensorboard": "the simulated fleet writes no metrics.jsonl to follow",
    "heartbeat": "availability on the simulated clock is exact, without status messages",
    "timeout": "it bounds wall-clock seconds; bound simulated ones with --budget",
    "http_models": "the simulated fleet has no broker and no downloads to move off it",
}
VIRTUAL_ONLY = ("budget", "sample_cost")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_mode_flags(args: argparse.Namespace) -> None:
    """CliError for a flag the chosen mode does not use, naming the mode it needs (module docstring)."""
    if not args.virtual:
        given = [_flag(n) for n in VIRTUAL_ONLY if getattr(args, n, None) is not None]
        if given:
            raise CliError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --virtual only (the "
                           f"simulated clock); the real fleet runs in wall-clock time (bound it with --timeout)")
        return
    for name, why in NOT_VIRTUAL.items():
        value = getattr(args, name, None)
        if value is not None and not (name == "shard" and value == "0/1"):
            raise CliError(f"{_flag(name)} does not apply to --virtual: {why}; it needs the real fleet "
                           f"(flayer emulate without --virtual)")


def _config(args: argparse.Namespace) -> Any:
    from cli.common import parse_set
    from emulator.options import load_emulate_config
    from flayer.config import ConfigError

    if args.join_ratio is not None:
        raise CliError("--join-ratio does not apply to emulate: the coordinator selects "
                       "ceil(over-selection x quorum) "
                       "online devices (--quorum, --over-selection)")
    overrides = {
        "run": {"strategy": args.strategy, "rounds": args.rounds, "seed": args.seed},
        "data": {"dataset": args.dataset, "data_dir": args.data_dir, "samples": args.samples,
                 "partition": args.partition, "clients": args.clients, "model": args.model,
                 "partition_file": args.partition_file},
        "train": {"lr": args.lr, "batch_size": args.batch_size, "local_epochs": args.local_epochs},
        "strategy": parse_set(args.set or []),
        "privacy": privacy_overrides(vars(args)),
        "federation": {"quorum": args.quorum, "over_selection": args.over_selection,
                       "min_devices": args.min_devices, "deadline_s": args.deadline, "grace_s": args.grace,
                       "value_codec": args.value_codec, "delta_downloads": args.delta_downloads,
                       "metrics_port": args.metrics_port, **mode_overrides(args)},
        "edge": {"heartbeat_s": args.heartbeat, "device": args.device, "threads": args.threads,
                 "upload": args.upload, "error_feedback": args.error_feedback},
        "emulator": {"profiles": _abs(args.profiles), "mix": args.mix, "trace": _abs(args.trace),
                     "trace_scale": args.trace_scale, "workers": args.workers, "network": args.network,
                     "model_slots": args.model_slots,
                     "federation": args.federation, "broker_kind": args.broker_kind,
                     "timeout_s": args.timeout, "http_models": args.http_models},
    }
    try:
        return load_emulate_config(args.config, overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc


def _abs(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def run(args: argparse.Namespace) -> int:
    from cli.report import table
    from emulator.fleet import parse_shard
    from emulator.launcher import EmulatorError, LaunchOptions, run_fleet
    from emulator.report import device_rows, profile_rows
    from flayer.config import ConfigError
    from flayer.data import DataError
    from flayer.partition import PartitionError
    from mqtt_broker import BrokerConfigError, BrokerError

    check_mode_flags(args)
    cfg = _config(args)
    if args.dp_plan:  # the coordinator's figures: N = the fleet, ceil(over-selection x quorum) asked, m = quorum
        import math

        from cli.privacy import plan_text
        from emulator.options import federation_table

        n, fed = cfg.run.data.clients, federation_table(cfg, cfg.run.data.clients)
        asked = min(n, max(fed["quorum"], math.ceil(fed["over_selection"] * fed["quorum"] - 1e-9)))
        print(plan_text(cfg.run.privacy, cfg.run.privacy.population or n, asked, cfg.run.rounds, fed["quorum"]))
        return 0
    if args.virtual and (cfg.run.privacy.enabled or cfg.run.privacy.secure_aggregation):
        raise CliError("[privacy]: --virtual does not run private or secure rounds yet; plan them with flayer "
                       "simulate (--dp-plan, --secure-drop: the same engine) or run the emulated fleet without "
                       "--virtual")
    if args.virtual:
        from cli.virtual import run_virtual_fleet

        return run_virtual_fleet(cfg, args)
    try:
        shard, shards = parse_shard(args.shard)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    run_cfg = cfg.run
    out = Path(args.out or run_cfg.out or f"runs/emulate-{run_cfg.strategy}-{run_cfg.data.dataset}-"
                                          f"{time.strftime('%Y%m%d-%H%M%S')}")
    opts = LaunchOptions(cfg, out, shard, shards, args.broker,
                         Path(args.broker_state) if args.broker_state else None,
                         args.verbose)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through the launcher, which stops what it started

    display = Display(run_cfg.rounds)
    dashboard = Dashboard(args.dashboard, args) if args.dashboard else None
    tb = TensorBoardSink(args.tensorboard, out.resolve() / "metrics.jsonl") if args.tensorboard else None

    def on_event(kind: str, info: dict[str, Any]) -> None:
        display(kind, info)
        if kind == "setup" and dashboard is not None:
            dashboard.start(Path(info["out"]), info["spec"])
        elif kind == "round" and tb is not None:
            tb.poll()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        result = run_fleet(opts, on_event)
    except (ConfigError, DataError, PartitionError, BrokerConfigError, BrokerError) as exc:
        raise CliError(str(exc)) from exc
    except EmulatorError as exc:
        print(f"flayer emulate: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
        if dashboard is not None:
            dashboard.stop()
        if tb is not None:
            tb.close()
    rows = result.rows
    if rows:
        print()
        print(table(["round", "reported", "online", "MB up", "MB down", "acc", "seconds", "closed"],
                    [(r["round"], f"{r['reported']}/{r['selected']}", r["online_close"], f"{r['mb_up']:.1f}",
                      f"{r['mb_down']:.1f}", r["acc"] if r["acc"] is not None else "-", f"{r['wall_s']:.1f}",
                      r["closed"]) for r in rows]))
    devices = device_rows(result)
    prof = profile_rows(devices)
    print()
    print(table(["profile", "devices", "updates sent", "accepted", "crashes", "final acc (mean)"],
                [(p["profile"], p["devices"], p["trained"], p["accepted"], p["crashes"],
                  p["mean_final_acc"] if p["mean_final_acc"] is not None else "-") for p in prof]))
    t = result.progress.totals()
    accs = [d["final_acc"] for d in devices if d["final_acc"] is not None]
    personal = f"personal models {sum(accs) / len(accs):.4f} mean over {len(accs)} devices" if accs else \
        "no personal model saved"
    if shard == 0:
        closed = rows and rows[-1]["acc"] is not None
        last = f"final round acc {rows[-1]['acc']:.4f}" if closed else "no round closed"
        print(f"\n{len(rows)}/{run_cfg.rounds} rounds in {result.run_s:.0f}s (setup {result.setup_s:.0f}s): "
              f"{last}, "
              f"{personal}")
    else:
        print(f"\nshard {shard}/{shards}: followed the federation to its end in {result.run_s:.0f}s (setup "
              f"{result.setup_s:.0f}s; shard 0 reports the rounds): {personal}")
    print(f"{t['crashes']} crashes, {t['offline_events']} times a device went offline, "
          f"{t['trained_updates']} updates trained, {t['errors']} device errors")
    if shard == 0 and run_cfg.privacy.enabled:
        print(privacy_line(result.out / "coordinator" / "metrics.jsonl"))
    if shard == 0 and run_cfg.privacy.secure_aggregation:
        print(secure_line(result.out / "coordinator" / "metrics.jsonl"))
    plots = device_plots(result, devices)
    files = ["metrics.jsonl" if shard == 0 else "", "rounds.jsonl", "devices.jsonl", "summary.json", *plots,
             "coordinator/metrics.jsonl" if shard == 0 else "",
             "logs/"]
    print(f"outputs in {result.out}/ ({', '.join(f for f in files if f)})", file=sys.stderr)
    return 0 if result.finished else 1
