"""Flags shared by the subcommands, the config they build, data + partition loading, output folders."""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.errors import CliError
from flayer.config import STRATEGY_NAMES, ConfigError, RunConfig, load_run_config
from flayer.data import DATASETS, DataError, Dataset, load_dataset
from flayer.partition import Partition, PartitionError, load_partition, make_partition
from flayer.spec import BUILTIN_NAMES, ENTRY_POINT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (a Jetson image): the same parser as the tomli package
    import tomli as tomllib

log = logging.getLogger(__name__)


def port_arg(text: str) -> int:
    """argparse type of every port flag: an integer in [0, 65535] (0: a free one)."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from exc
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: a free one), got {value}")
    return value


def model_arg(text: str) -> str:
    """argparse type of ``--model``: a built-in model or an entry point ``package.module:function`` (the
    registry builds either; an entry point is imported only where it is allowed: docs/howto/own-model.md)."""
    if text in BUILTIN_NAMES or ENTRY_POINT.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(f"expected {', '.join(BUILTIN_NAMES)} or an entry point "
                                     f"package.module:function, got {text!r}")


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, PartitionError)


def add_common_flags(p: argparse.ArgumentParser, rounds: bool = True, strategy: bool = True) -> None:
    """The flags every command that runs a federation shares (docs/reference/cli.md)."""
    g = p.add_argument_group("run (flags override --config)")
    g.add_argument("--config", metavar="FILE.toml", help="run config: tables [run], [data], [train], [strategy.NAME]")
    g.add_argument("--dataset", choices=DATASETS)
    g.add_argument("--data-dir", metavar="PATH", help="folder holding the data set's files")
    g.add_argument("--samples", type=int, metavar="N", help="seeded class-stratified subsample before partitioning")
    g.add_argument("--partition", metavar="dir0.1|pat2|iid")
    g.add_argument("--partition-file", metavar="PATH", help="use a saved partition (from 'flayer partition --save')")
    g.add_argument("--clients", type=int, metavar="N")
    g.add_argument("--seed", type=int, metavar="S")
    if rounds:
        g.add_argument("--rounds", type=int, metavar="R")
        g.add_argument("--join-ratio", type=float, metavar="F", help="fraction of clients selected per round")
    if strategy:
        g.add_argument("--strategy", choices=STRATEGY_NAMES)
        g.add_argument("--lr", type=float, help="base learning rate")
        g.add_argument("--batch-size", type=int)
        g.add_argument("--local-epochs", type=int)
        g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N or mps")
        g.add_argument("--threads", type=int, help="torch threads (0 = torch's default)")
        g.add_argument("--set", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                       help="a strategy option, e.g. --set flayer.server_rule=zero (VALUE in TOML syntax)")
    g.add_argument("--model", type=model_arg, metavar="NAME",
                   help=f"{', '.join(BUILTIN_NAMES)} or an entry point package.module:function (docs/howto/"
                        f"own-model.md); default: cnn for images, fasttext for text")
    g.add_argument("--out", metavar="DIR", help="output folder (default: runs/<command>-<time>)")


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_set(items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, dot, opt = key.strip().rpartition(".")
        if not sep or not dot or not name or not opt:
            raise CliError(f"--set {item!r}: expected STRATEGY.KEY=VALUE, e.g. flayer.server_rule=zero")
        out.setdefault(name, {})[opt] = _toml_value(value.strip())
    return out


def run_config(args: argparse.Namespace) -> RunConfig:
    """Merge --config and the flags (flags win) into a validated RunConfig."""
    from cli.privacy import privacy_overrides

    a = vars(args)
    overrides: dict[str, Any] = {
        "run": {"strategy": a.get("strategy"), "rounds": a.get("rounds"), "seed": a.get("seed"),
                "join_ratio": a.get("join_ratio"), "out": a.get("out")},
        "data": {"dataset": a.get("dataset"), "data_dir": a.get("data_dir"), "samples": a.get("samples"),
                 "partition": a.get("partition"), "clients": a.get("clients"), "model": a.get("model"),
                 "partition_file": a.get("partition_file")},
        "train": {"lr": a.get("lr"), "batch_size": a.get("batch_size"), "local_epochs": a.get("local_epochs"),
                  "device": a.get("device"), "threads": a.get("threads")},
        "strategy": parse_set(a.get("set") or []),
        "privacy": privacy_overrides(a),
    }
    try:
        return load_run_config(a.get("config"), overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc


@dataclass(frozen=True)
class Prepared:
    dataset: Dataset
    partition: Partition


def load_data(cfg: RunConfig) -> Prepared:
    """Load the data set and make (or read) the partition the config names."""
    try:
        ds = load_dataset(cfg.data.dataset, cfg.data.data_dir)
        if cfg.data.partition_file:
            part = load_partition(cfg.data.partition_file, len(ds), ds.fingerprint())
            if part.num_clients != cfg.data.clients:
                log.warning("the partition file holds %d clients; using those (clients = %d ignored)",
                            part.num_clients, cfg.data.clients)
        else:
            part = make_partition(ds.y, ds.num_classes, cfg.data.clients, cfg.data.partition, cfg.partition_seed,
                                  samples=cfg.data.samples, test_fraction=cfg.data.test_fraction,
                                  val_fraction=cfg.data.val_fraction, batch_size=cfg.train.batch_size,
                                  meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()})
    except (DataError, PartitionError) as exc:
        raise CliError(str(exc)) from exc
    return Prepared(ds, part)


def out_dir(cfg: RunConfig, command: str) -> Path:
    path = Path(cfg.out) if cfg.out else Path("runs") / f"{command}-{cfg.strategy}-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def set_threads(cfg: RunConfig) -> None:
    if cfg.train.threads > 0:
        import torch

        torch.set_num_threads(cfg.train.threads)


def add_mode_flags(p: Any) -> None:
    """``--mode`` and the asynchronous rounds' settings (the ``[federation]`` keys of the same names)."""
    p.add_argument("--mode", choices=("sync", "async"),
                   help="synchronous rounds, or asynchronous buffered ones (default: the config's, else sync)")
    p.add_argument("--buffer", type=int, metavar="K", help="async: accepted updates per new model version (8)")
    p.add_argument("--max-staleness", type=int, metavar="S",
                   help="async: updates trained more versions ago are refused (default auto: ceil(24 x concurrency / "
                        "buffer))")
    p.add_argument("--staleness", choices=("sqrt", "inverse", "constant"),
                   help="async: weight of a stale update's deltas: 1/sqrt(1+s) (default), 1/(1+s), or 1")
    p.add_argument("--concurrency", type=int, metavar="N", help="async: devices training at once (default auto: "
                                                                  "ceil(over_selection x buffer); 0: all online)")


def mode_overrides(args: Any) -> dict[str, Any]:
    """The ``[federation]`` overrides of :func:`add_mode_flags` (None: not given)."""
    return {"mode": args.mode, "buffer": args.buffer, "max_staleness": args.max_staleness,
            "staleness": args.staleness, "concurrency": args.concurrency}
