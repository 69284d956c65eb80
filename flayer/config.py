"""Frozen dataclass configs, loaded once from TOML and passed down.

A run file has tables ``[run]``, ``[data]``, ``[train]`` and one ``[strategy.<name>]`` table per
strategy's own options. Command-line flags override the file. Every key and type is checked;
errors name the file, the table and the key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .data import DATASETS
from .privacy_config import PrivacySettings

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (a Jetson image): the same parser as the tomli package
    import tomli as tomllib

__all__ = [
    "DEFAULT_LRS",
    "STRATEGY_NAMES",
    "ConfigError",
    "DataConfig",
    "RunConfig",
    "TrainConfig",
    "add_python_path",
    "from_mapping",
    "load_run_config",
    "read_toml",
]

STRATEGY_NAMES = ("local", "fedavg", "fedper", "fedrep", "lgfedavg", "ditto", "fedala", "fedbabu",
                  "playerfl", "flayer", "flayer-ref")
DATASET_NAMES = DATASETS  # the one list, beside the loaders in flayer.data
# Each method's base learning rate when neither a config file nor --lr gives one: its stable choice in
# `make tune-table` (Fashion-MNIST Dir(0.1), 20 clients, 12,000 images, batch 10, one local epoch): the
# best validation accuracy among the rates whose double also trained without diverging. The margin
# matters: on all 70,000 images (six times the steps per round) FLAYER at 0.1, its best subset rate,
# diverged in round 3 (docs/results/bench-fmnist.md). Another data set or model may want other rates:
# `flayer tune` chooses them the same way.
DEFAULT_LRS: dict[str, float] = {"flayer": 0.05, "flayer-ref": 0.01, "local": 0.05, "lgfedavg": 0.02, "fedala": 0.1,
                                 "fedper": 0.05, "ditto": 0.05, "fedrep": 0.05, "fedbabu": 0.1, "playerfl": 0.05,
                                 "fedavg": 0.1}


class ConfigError(ValueError):
    """A config file or flag is wrong; the message says where and what was expected."""


T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: expected one of {', '.join(map(repr, typing.get_args(tp)))}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return from_mapping(tp, value, where)
    return value


def from_mapping(cls: type[T], mapping: Mapping[str, Any], where: str) -> T:
    """Build frozen dataclass ``cls`` from ``mapping``, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(mapping) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in mapping.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "fmnist"
    data_dir: str | None = None
    samples: int | None = None
    partition: str = "dir0.1"
    clients: int = 20
    test_fraction: float = 0.25
    val_fraction: float = 0.1
    model: str | None = None
    partition_file: str | None = None
    partition_seed: int | None = None  # default: the run seed

    def __post_init__(self) -> None:
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"dataset {self.dataset!r} is not one of {', '.join(DATASET_NAMES)}")
        if self.clients < 1:
            raise ConfigError(f"clients must be >= 1, got {self.clients}")
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"samples must be >= 1, got {self.samples}")
        if not 0 < self.test_fraction < 1 or not 0 <= self.val_fraction < 1:
            raise ConfigError("test_fraction must be in (0, 1) and val_fraction in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 0.005  # base learning rate (SGD without momentum); a run config takes DEFAULT_LRS[strategy]
    batch_size: int = 10
    local_epochs: int = 1  # local epochs per round
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    amp: bool = True  # mixed precision on CUDA

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.batch_size < 1 or self.local_epochs < 1:
            raise ConfigError("batch_size and local_epochs must be >= 1")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")


@dataclass(frozen=True)
class RunConfig:
    strategy: str = "flayer"  # the method: one of STRATEGY_NAMES
    rounds: int = 20  # federation rounds
    seed: int = 0  # every draw follows from it: partition (unless partition_seed), selection, training
    join_ratio: float = 1.0  # fraction of the clients selected each round
    eval_every: int = 1  # checked but not used yet: every round is evaluated
    out: str | None = None  # output folder (default: runs/<command>-<strategy>-<dataset>-<time>)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # per-strategy option tables, validated by the strategy that reads them
    strategy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)  # [privacy]: client-level DP (off)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGY_NAMES)}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if not 0 < self.join_ratio <= 1:
            raise ConfigError(f"join_ratio must be in (0, 1], got {self.join_ratio}")
        if self.eval_every < 1:
            raise ConfigError(f"eval_every must be >= 1, got {self.eval_every}")

    @property
    def partition_seed(self) -> int:
        return self.seed if self.data.partition_seed is None else self.data.partition_seed

    def options(self, strategy: str | None = None) -> Mapping[str, Any]:
        return self.strategy_options.get(strategy or self.strategy, {})


def add_python_path(folders: Any, base: Path, where: str) -> None:
    """Add ``folders`` (relative to ``base``) to the end of ``sys.path``, so that entry points in them import (a
    federation's own model, a device's python data source). After the project and every installed package, never
    before: a ``PIL.py`` or ``numpy.py`` in one of them is never imported for the real one. A folder another user
    can write (group or world write bits, or owned by someone else than this user or root, e.g. ``/tmp`` or a
    shared download folder) is refused: whatever is put there would run as this user."""
    import os
    import stat
    import sys

    if not isinstance(folders, list) or not all(isinstance(f, str) and f for f in folders):
        raise ConfigError(f"{where} python_path must be a list of folders, got {folders!r}")
    for folder in folders:
        p = Path(folder).expanduser()
        path = (p if p.is_absolute() else base / p).resolve()
        if not path.is_dir():
            raise ConfigError(f"{where} python_path: {path} is not a folder")
        st = path.stat()
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{where} python_path: {path} can be written by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): a module put there would run "
                              f"as this user; keep the code (and a kit) in a folder of your own")
        for up in path.parents:  # a folder above it that others may write could swap it for their own
            ust = up.stat()
            if (ust.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not ust.st_mode & stat.S_ISVTX) \
                    or ust.st_uid not in (os.geteuid(), 0):
                raise ConfigError(f"{where} python_path: {path} lies in {up}, which other users can write (mode "
                                  f"{stat.S_IMODE(ust.st_mode):04o}, owner uid {ust.st_uid}): they could put a folder "
                                  f"of their own in its place; keep the code (and a kit) in a folder of your own")
        if str(path) not in sys.path:
            sys.path.append(str(path))


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc


def load_run_config(path: str | Path | None = None,
                    overrides: Mapping[str, Mapping[str, Any]] | None = None) -> RunConfig:
    """Read ``path`` (optional), then apply ``overrides`` ({"run"|"data"|"train": {...},
    "strategy": {name: {...}}}), validating everything. Flags win over the file."""
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    src = str(path) if path is not None else "flags"
    unknown = sorted(set(raw) - {"run", "data", "train", "strategy", "privacy"})
    if unknown:
        raise ConfigError(f"{src}: unknown table(s) {', '.join(unknown)}; known: run, data, train, strategy, privacy")
    merged: dict[str, dict[str, Any]] = {k: dict(raw.get(k, {})) for k in ("run", "data", "train", "privacy")}
    strategy_tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in raw.get("strategy", {}).items()}
    for table, values in (overrides or {}).items():
        if table == "strategy":
            for name, opts in values.items():
                strategy_tables.setdefault(name, {}).update(opts)
        else:
            merged.setdefault(table, {}).update({k: v for k, v in values.items() if v is not None})
    for name, opts in strategy_tables.items():
        if name not in STRATEGY_NAMES:
            raise ConfigError(f"{src}: [strategy.{name}] names no strategy; known: {', '.join(STRATEGY_NAMES)}")
        if not isinstance(opts, Mapping):
            raise ConfigError(f"{src}: [strategy.{name}] must be a table")
    nested = {"data", "train", "strategy_options", "privacy"} & set(merged["run"])
    if nested:
        raise ConfigError(f"{src} [run]: {', '.join(sorted(nested))} belong in their own table, not in [run]")
    data = from_mapping(DataConfig, merged["data"], f"{src} [data]")
    if "lr" not in merged["train"]:  # the method's tuned default (DEFAULT_LRS)
        merged["train"]["lr"] = DEFAULT_LRS.get(str(merged["run"].get("strategy", RunConfig.strategy)), TrainConfig.lr)
    train = from_mapping(TrainConfig, merged["train"], f"{src} [train]")
    privacy = from_mapping(PrivacySettings, merged["privacy"], f"{src} [privacy]")
    run = {**merged["run"], "data": data, "train": train, "strategy_options": strategy_tables, "privacy": privacy}
    return from_mapping(RunConfig, run, f"{src} [run]")
