"""``flayer edge --config device.toml`` (or ``--kit KIT.tar.gz``): one device of the federation.

Connects with the credentials ``flayer broker add-device`` wrote (``--kit``: unpacks the startup kit
beside it first and runs from it), loads this device's data (its own folder, arrays file or Python
source, or a share of a public data set), then follows the coordinator's plans: downloads
the global model, runs the local round, uploads, waits for the ack. Its state stays in the state
folder, so a restarted device resumes. After the federation ends it saves its personal model
(``personal.safetensors``, for ``flayer export``) and exits 0. Ctrl-C / SIGTERM stop it cleanly
(exit 130 / 143); a configuration error, a refused connection (a password the broker refuses, or a TLS
certificate it refuses at every handshake: revoked, replaced, expired) or an update over the size limit
exits 2 with one line saying why; a broker that is down is retried for ever. ``--print-unit`` prints a systemd unit that runs this command as a
service (docs/howto/service.md); ``[edge] label`` names the device's kind in the coordinator's metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any

from cli.common import CliError
from cli.logfile import add_log_file_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("edge", help="run one edge device of the federation", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", metavar="FILE.toml", help="device.toml: credentials, [data], [edge]")
    src.add_argument("--kit", metavar="KIT.tar.gz",
                     help="the startup kit from 'flayer broker add-device ID --kit': unpacked into a folder beside it "
                          "(kept for restarts), then run from its device.toml")
    p.add_argument("--data", metavar="PATH",
                   help="the device's data: its image folder or arrays file ([data] path), or for a partition the "
                        "data set's folder ([data] data_dir)")
    p.add_argument("--partition-file", metavar="PATH", help="the saved partition (overrides the config)")
    p.add_argument("--client", type=int, metavar="K", help="this device's index in the partition")
    p.add_argument("--state-dir", metavar="DIR", help="where the device keeps its state (overrides the config)")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N or mps")
    p.add_argument("--allow-entry-point", action="append", default=[], metavar="PKG.MODULE:FUNCTION",
                   help="model code a plan may name besides the built-ins (added to [edge] allow_entry_points); "
                        "repeatable. A plan naming any other entry point is refused before anything is imported")
    p.add_argument("--allow-kit-code", action="store_true",
                   help="with --kit: run the code the kit's device.toml names ([data] entry, [edge] "
                        "allow_entry_points); without it such a kit is refused before anything is unpacked or "
                        "imported (a model entry point may instead be allowed by --allow-entry-point)")
    p.add_argument("--runtime", choices=("torch", "executorch"),
                   help="where the local SGD runs: torch (default) or the model's ExecuTorch training program "
                        "(CPU; cnn and fasttext; needs the 'executorch' extra)")
    add_log_file_flag(p)
    from cli.unit import add_unit_flags

    add_unit_flags(p)
    p.set_defaults(func=run)


def _show(kind: str, info: dict[str, Any]) -> None:
    if kind == "trained":
        acc = f"{info['acc']:.4f}" if info.get("acc") is not None else "-"
        loss = f", train loss {info['train_loss']:.4f}" if info.get("train_loss") is not None else ""
        sent = "masking the update once the round's shares are in" if info.get("secure") else \
            f"sent {info['bytes'] / 1e6:.2f} MB"
        print(f"round {info['round']}: trained, {sent} (test acc before training {acc}{loss})", flush=True)
    elif kind == "sent":  # a secure round's masked input, sent once the shares were in
        print(f"round {info['round']}: sent {info['bytes'] / 1e6:.2f} MB (the masked update of a secure round)",
              flush=True)
    elif kind == "ack":
        reason = f" ({info['reason']})" if info.get("reason") else ""
        print(f"round {info['round']}: {info['status']}{reason}", flush=True)
    elif kind == "finished":
        print(f"federation finished: personal model test acc {info['acc']:.4f}, saved to {info['path']}", flush=True)


def run(args: argparse.Namespace) -> int:
    from edge_client.client import EdgeClient
    from edge_client.config import load_device_config, load_device_data
    from edge_client.work import EdgeError
    from flayer.config import ConfigError
    from flayer.data import DataError
    from flayer.partition import PartitionError
    from flayer.state import StateFileError
    from transport import Credentials, CredentialsError
    from transport.kit import unpack_kit

    def absolute(path: str | None) -> str | None:  # flags are relative to the working directory
        return str(Path(path).resolve()) if path else None

    overrides = {"data": {"data_path": absolute(args.data), "partition_file": absolute(args.partition_file),
                          "client": args.client},
                 "edge": {"state_dir": absolute(args.state_dir), "device": args.device, "runtime": args.runtime}}
    if args.print_unit:  # nothing is unpacked or started (cli.unit)
        return _print_unit(args, overrides)
    try:
        config = unpack_kit(args.kit, allow_code=args.allow_kit_code, allowed_entry_points=args.allow_entry_point) \
            if args.kit else args.config
        cfg = load_device_config(config, overrides)
        if args.allow_entry_point:  # added to the file's list (validated as entry points by EdgeSettings)
            allow = tuple(dict.fromkeys([*cfg.edge.allow_entry_points, *args.allow_entry_point]))
            cfg = dataclasses.replace(cfg, edge=dataclasses.replace(cfg.edge, allow_entry_points=allow))
        creds = Credentials.load(cfg.credentials)
        data = load_device_data(cfg.data)
        if cfg.edge.threads > 0:
            import torch

            torch.set_num_threads(cfg.edge.threads)
        client = EdgeClient(cfg.edge, creds, data, on_progress=_show)
    except (ConfigError, CredentialsError, DataError, PartitionError, StateFileError, EdgeError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    got: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        client.stop(timeout=0)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if cfg.data.source == "partition":
        what = f"client {cfg.data.client} of {cfg.data.partition_file}, {data.num_train} training samples"
    else:
        what = f"{cfg.data.source} {cfg.data.path or cfg.data.entry}, loaded for the federation's model"
    where = f"{creds.tls.host}:{creds.tls.port} (TLS)" if creds.tls else f"{creds.host}:{creds.port}"
    print(f"device {creds.username} ({what}, {client.device}) -> {where}, federation {creds.federation}",
          file=sys.stderr)
    try:
        client.run()
    except EdgeError as exc:
        raise CliError(str(exc)) from exc
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    trained = ", ".join(map(str, client.rounds_trained)) or "none"
    print(f"{creds.username}: trained rounds {trained}"
          f"{f'; personal model in {client.store.personal_file}' if client.finished else ''}")
    if got:
        return 128 + got[0]
    return 0


def _print_unit(args: argparse.Namespace, overrides: dict[str, dict[str, Any]]) -> int:
    """The unit's state folders: the kit's folder (its state is inside), or the config's [edge] state_dir."""
    from cli.unit import print_unit
    from edge_client.config import load_device_config
    from flayer.config import ConfigError
    from transport.kit import kit_folder

    if args.kit:
        return print_unit(args, "edge", [kit_folder(Path(args.kit).resolve())], Path(args.kit).name)
    try:
        cfg = load_device_config(args.config, overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    return print_unit(args, "edge", [Path(cfg.edge.state_dir)], Path(args.config).name)
