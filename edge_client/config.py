"""``device.toml``: a device's credentials, its share of the data and how it behaves on the link.

::

    credentials = "../.flayer/broker/credentials/dev-1.toml"   # from 'flayer broker add-device'
                                                               # (relative paths: to this file)
    [data]
    dataset = "fmnist"
    data_dir = "/usr/share/datasets/fashion-mnist"   # optional (the data set's default folder)
    partition_file = "runs/fmnist-5.npz"              # from 'flayer partition --save'
    client = 0                                        # this device's index in the partition

    [edge]
    state_dir = "runs/dev-1"     # personal state, pending upload, final models
    device = "auto"              # auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps
    threads = 0                  # torch threads (0 = torch's default)
    runtime = "torch"            # or "executorch": local SGD through the model's ExecuTorch training program
    amp = true                   # bf16 autocast for the local round on CUDA
    heartbeat_s = 30.0           # retained status every heartbeat_s
    ack_timeout_s = 30.0         # re-send an update not acknowledged within this time...
    retries = 5                  # ...this many times, with exponential backoff and jitter:
    backoff_s = 2.0              #    min(backoff_max_s, backoff_s * 2**attempt) * (1 + U[0, 0.5))
    backoff_max_s = 60.0
    download_stall_s = 30.0      # re-subscribe to the model when no chunk came for this long
    max_update_bytes = 0         # refuse larger updates before sending (0: the plan's limit)
    exit_when_finished = true    # save the personal model and exit after the final plan

Relative paths (credentials, data_dir, partition_file, state_dir) are read relative to this file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flayer.config import DATASET_NAMES, ConfigError, from_mapping, read_toml

__all__ = ["DeviceConfig", "DeviceData", "EdgeSettings", "load_device_config", "load_device_data"]


@dataclass(frozen=True)
class EdgeSettings:
    state_dir: str = "runs/edge"
    client_index: int = 0  # the device's index in the partition (RoundContext.client)
    device: str = "auto"
    threads: int = 0
    runtime: str = "torch"
    amp: bool = True
    heartbeat_s: float = 30.0
    ack_timeout_s: float = 30.0
    retries: int = 5
    backoff_s: float = 2.0
    backoff_max_s: float = 60.0
    download_stall_s: float = 30.0
    publish_timeout_s: float = 120.0
    max_update_bytes: int = 0
    exit_when_finished: bool = True
    keepalive_s: int = 30

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "ack_timeout_s", "backoff_s", "backoff_max_s", "download_stall_s",
                     "publish_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0 or self.threads < 0 or self.max_update_bytes < 0 or self.client_index < 0:
            raise ConfigError("retries, threads, max_update_bytes and client must be >= 0")
        if self.runtime not in ("torch", "executorch"):
            raise ConfigError(f"runtime must be \"torch\" or \"executorch\", got {self.runtime!r}")
        if self.runtime == "executorch" and self.device not in ("auto", "cpu"):
            raise ConfigError(f"runtime executorch runs on the CPU; device = {self.device!r} (use \"cpu\" or \"auto\")")
        if not 5 <= self.keepalive_s <= 3600:
            raise ConfigError(f"keepalive_s must be in [5, 3600], got {self.keepalive_s}")


@dataclass(frozen=True)
class DeviceData:
    dataset: str
    partition_file: str
    client: int
    data_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"dataset {self.dataset!r} is not one of {', '.join(DATASET_NAMES)}")
        if self.client < 0:
            raise ConfigError(f"client must be >= 0, got {self.client}")


@dataclass(frozen=True)
class DeviceConfig:
    credentials: Path
    data: DeviceData
    edge: EdgeSettings


def load_device_config(path: str | Path, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> DeviceConfig:
    """Read and validate ``device.toml``; ``overrides`` = {"data": {...}, "edge": {...}} (flags win; give
    their paths absolute)."""
    path = Path(path)
    raw = read_toml(path)
    unknown = sorted(set(raw) - {"credentials", "data", "edge"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) or table(s) {', '.join(unknown)}; known: credentials, [data], "
                          f"[edge]")
    creds = raw.get("credentials")
    if not isinstance(creds, str) or not creds:
        raise ConfigError(f"{path}: credentials = \"PATH\" (the file 'flayer broker add-device' wrote) is required")
    tables: dict[str, dict[str, Any]] = {k: dict(raw.get(k, {})) for k in ("data", "edge")}
    for table, values in (overrides or {}).items():
        tables.setdefault(table, {}).update({k: v for k, v in values.items() if v is not None})
    missing = sorted({"dataset", "partition_file", "client"} - set(tables["data"]))
    if missing:
        raise ConfigError(f"{path} [data]: missing key(s) {', '.join(missing)}")
    base = path.resolve().parent

    def resolve(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        p = Path(value).expanduser()
        return str((p if p.is_absolute() else base / p).resolve())

    for table, key in (("data", "data_dir"), ("data", "partition_file"), ("edge", "state_dir")):
        if key in tables[table]:
            tables[table][key] = resolve(tables[table][key])
    data = from_mapping(DeviceData, tables["data"], f"{path} [data]")
    edge = from_mapping(EdgeSettings, {**tables["edge"], "client_index": data.client}, f"{path} [edge]")
    return DeviceConfig(Path(resolve(creds)), data, edge)


def load_device_data(data: DeviceData) -> Any:
    """This device's :class:`flayer.train.ClientData`: the data set, the saved partition (checked
    against the data set's fingerprint) and the device's index in it."""
    from flayer.data import load_dataset
    from flayer.partition import PartitionError, load_partition
    from flayer.train import client_data

    ds = load_dataset(data.dataset, data.data_dir)
    part = load_partition(data.partition_file, len(ds), ds.fingerprint())
    if data.client >= part.num_clients:
        raise PartitionError(f"client {data.client} is not in {data.partition_file} "
                             f"({part.num_clients} clients: 0..{part.num_clients - 1})")
    return client_data(ds, part.clients[data.client])
