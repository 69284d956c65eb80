"""``device.toml``: a device's credentials, its own data and how it behaves on the link.

::

    credentials = "credentials.toml"   # from 'flayer broker add-device' (relative paths: to this file)
    python_path = ["."]                # optional: folders searched for entry points (model, python source)

    [data]
    source = "folder"            # folder | arrays | python | partition (see edge_client.sources)
    path = "my-images"           # folder: <path>/<class name>/*.png|jpg; arrays: a .npz or .safetensors (x, y)
    resize = false               # folder: resize/convert images to the model's input instead of refusing them
    # entry = "mypkg.sensors:dataset"   python: returns a torch Dataset or (train, val, test)
    # args = { window = 64 }            ... called with these keyword arguments
    val_fraction = 0.1           # the device's own seeded split: validation (FLAYER's A_l) ...
    test_fraction = 0.2          # ... and test; the rest trains
    seed = 0

    # source = "partition": a share of a public data set (emulation, benchmarks, tests)
    # dataset = "fmnist"; data_dir = "/usr/share/datasets/fashion-mnist" (optional)
    # partition_file = "runs/fmnist-5.npz"   (from 'flayer partition --save'); client = 0

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
    http_models = true           # fetch the model over HTTP when the plan names a models_url (else the chunks)
    http_timeout_s = 30.0        # ... giving up (and taking the broker's chunks) after this long without a byte
    http_deadline_s = 600.0      # ... or when one model's fetch is not done after this long, however it trickles
    models_hosts = []            # hosts that get this device's models token besides its broker's (the model server)
    models_plain_http = false    # ... also over plain http beyond loopback (else https only: the token travels in clear)
    max_update_bytes = 0         # refuse larger updates before sending (0: the plan's limit)
    exit_when_finished = true    # save the personal model and exit after the final plan
    upload = "plan"              # or "fit": value codec and top-k share fitted to the uplink and the round's close
    uplink_kbps = 0.0            # the uplink for "fit" (0: estimated from this device's acknowledged uploads)
    error_feedback = false       # keep what the codec / top-k left out (on disk) and add it to the next update
    allow_entry_points = []      # model code a plan may name besides the built-ins, e.g. ["mypkg.models:build"]
    label = ""                   # this device's kind, e.g. "jetson-orin": the coordinator's metrics count devices by it

    [privacy]                    # optional: this device's own privacy budget (docs/explanation/privacy.md)
    device_budget = 4.0          # refuse private rounds once the next contribution would pass this epsilon
    delta = 1e-5                 # the delta it counts at (the smaller of this and the plan's; default: 1e-5)
    secure_corrupt_fraction = 0.0  # secure rounds: the colluding fraction this device assumes (t's floor), at least
    max_participations = 2       # the participation schema it pins: refuse a plan naming more (or none), and a 3rd round
    min_separation = 3           # ... or a plan allowing rounds closer than this, and a round within 3 of its last
    require = "secure"           # every round it takes part in: "private", "local", "secure", a list of them, or "none"

Relative paths (credentials, python_path, path, data_dir, partition_file, state_dir) are read
relative to this file. A [data] table without ``source`` but with ``dataset`` is a partition.

What code runs here is this file's decision: a round plan naming a model entry point that is neither a
built-in nor listed in ``[edge] allow_entry_points`` (or ``flayer edge --allow-entry-point``) is refused
before anything is imported (docs/explanation/security.md). ``[data] entry`` is this file's own choice
and needs no listing; ``python_path`` only says where allowed modules are found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flayer.config import DATASET_NAMES, ConfigError, add_python_path, from_mapping, read_toml
from flayer.spec import ENTRY_POINT
from protocol.messages import DEVICE_LABEL

from .privacy_floor import parse_require

_HOST = re.compile(r"[A-Za-z0-9.:-]{1,253}")

__all__ = ["DeviceConfig", "DeviceData", "DevicePrivacy", "EdgeSettings", "load_device_config", "load_device_data"]


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
    http_models: bool = True  # fetch the plan's model and deltas from its models_url when it names one (docs/howto/http-models.md)
    http_timeout_s: float = 30.0  # an HTTP fetch silent this long falls back to the broker's chunks
    http_deadline_s: float = 600.0  # an HTTP fetch not finished after this long falls back too (a slow drip)
    models_hosts: tuple[str, ...] = ()  # hosts the models token goes to besides the broker's (transport.models_auth)
    models_plain_http: bool = False  # the token may go over plain http beyond loopback to those hosts
    publish_timeout_s: float = 120.0
    max_update_bytes: int = 0
    exit_when_finished: bool = True
    keepalive_s: int = 30
    upload: str = "plan"  # plan: the plan's codec; fit: codec and top-k share fitted to the uplink and round close
    uplink_kbps: float = 0.0
    error_feedback: bool = False
    allow_entry_points: tuple[str, ...] = ()  # model entry points a plan may name besides the built-ins
    label: str = ""  # the device's kind (e.g. "jetson-orin"), in its status: the coordinator's metrics count by it
    device_budget: float = 0.0  # [privacy] device_budget: refuse private rounds past this epsilon (0: none)
    device_delta: float = 0.0  # [privacy] delta: the delta this device counts its epsilon at (0: 1e-5, or the plan's if smaller)
    secure_corrupt_fraction: float = 0.0  # [privacy]: secure rounds' colluders this device assumes, whatever the plan says
    max_participations: int = 0  # [privacy]: the participation schema this device pins: at most k rounds (0: none)
    min_separation: int = 0  # [privacy]: ... and b rounds apart at least (0: none)
    privacy_require: tuple[str, ...] = ()  # [privacy] require: what every round it takes part in runs under (none)

    def __post_init__(self) -> None:
        bad = [e for e in self.allow_entry_points if not (isinstance(e, str) and ENTRY_POINT.fullmatch(e))]
        if bad:
            raise ConfigError(f"allow_entry_points: {bad[0]!r} is not an entry point \"package.module:function\" "
                              f"(the built-in models are always allowed)")
        if not all(isinstance(h, str) and _HOST.fullmatch(h) for h in self.models_hosts):
            raise ConfigError(f"models_hosts must be a list of host names or addresses, got {list(self.models_hosts)!r}")
        if self.label and not DEVICE_LABEL.fullmatch(self.label):
            raise ConfigError(f"label must be 1-40 letters, digits or _.:- (starting with a letter or digit), got "
                              f"{self.label!r}")
        for name in ("heartbeat_s", "ack_timeout_s", "backoff_s", "backoff_max_s", "download_stall_s",
                     "publish_timeout_s", "http_timeout_s", "http_deadline_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0 or self.threads < 0 or self.max_update_bytes < 0 or self.client_index < 0:
            raise ConfigError("retries, threads, max_update_bytes and client must be >= 0")
        if self.runtime not in ("torch", "executorch"):
            raise ConfigError(f"runtime must be \"torch\" or \"executorch\", got {self.runtime!r}")
        if self.runtime == "executorch" and self.device not in ("auto", "cpu"):
            raise ConfigError(f"runtime executorch runs on the CPU; device = {self.device!r} (use \"cpu\" or \"auto\")")
        if self.upload not in ("plan", "fit"):
            raise ConfigError(f"upload must be \"plan\" or \"fit\", got {self.upload!r}")
        if not (self.uplink_kbps >= 0 and self.uplink_kbps < float("inf")):
            raise ConfigError(f"uplink_kbps must be a finite number >= 0 (0: estimated), got {self.uplink_kbps}")
        if not (0 <= self.device_budget < float("inf")):
            raise ConfigError(f"[privacy] device_budget must be a finite epsilon > 0 (or 0: none), got "
                              f"{self.device_budget}")
        if not 0 <= self.device_delta < 1:
            raise ConfigError(f"[privacy] delta must be in (0, 1) (or 0: 1e-5), got {self.device_delta}")
        if not 0 <= self.secure_corrupt_fraction < 0.5:
            raise ConfigError(f"[privacy] secure_corrupt_fraction must be in [0, 0.5), got {self.secure_corrupt_fraction}")
        _check_schema(self.max_participations, self.min_separation, "[privacy] ")
        try:
            if parse_require(list(self.privacy_require)) != tuple(self.privacy_require):
                raise ValueError(f"require must be sorted and without repeats, got {list(self.privacy_require)!r}")
        except ValueError as exc:
            raise ConfigError(f"[privacy] {exc}") from None
        if not 5 <= self.keepalive_s <= 3600:
            raise ConfigError(f"keepalive_s must be in [5, 3600], got {self.keepalive_s}")


def _check_schema(most: Any, separation: Any, where: str) -> None:
    for name, v in (("max_participations", most), ("min_separation", separation)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 10**6:
            raise ConfigError(f"{where}{name} must be an integer in [0, 1000000] (0: none), got {v!r}")


@dataclass(frozen=True)
class DevicePrivacy:
    """``[privacy]`` of ``device.toml``: this device's own budget (edge_client.budget); the edge client
    reads them as ``EdgeSettings.device_budget`` and ``device_delta``."""

    device_budget: float = 0.0  # refuse private rounds once the next contribution would pass this epsilon (0: none)
    delta: float = 0.0  # the delta this device counts its epsilon at: the smaller of this and the plan's (0: 1e-5)
    secure_corrupt_fraction: float = 0.0  # secure rounds: colluders this device assumes (t's floor), at least
    max_participations: int = 0  # the participation schema it pins: plans must name at most k rounds (0: none)
    min_separation: int = 0  # ... and at least b rounds apart (0: none)
    require: str | tuple[str, ...] = "none"  # what every round it takes part in runs under (edge_client.privacy_floor)

    def __post_init__(self) -> None:
        _check_schema(self.max_participations, self.min_separation, "")
        parse_require(self.require)  # ValueError naming the bad value
        if not (0 <= self.device_budget < float("inf")):
            raise ConfigError(f"device_budget must be a finite epsilon > 0 (or 0: none), got {self.device_budget}")
        if not 0 <= self.delta < 1:
            raise ConfigError(f"delta must be in (0, 1) (or 0: 1e-5), got {self.delta}")
        if not 0 <= self.secure_corrupt_fraction < 0.5:
            raise ConfigError(f"secure_corrupt_fraction must be in [0, 0.5), got {self.secure_corrupt_fraction}")


SOURCES = ("folder", "arrays", "python", "partition")
_SOURCE_KEYS = {
    "partition": {"dataset", "partition_file", "client", "data_dir"},
    "folder": {"path", "resize"},
    "arrays": {"path"},
    "python": {"entry", "args"},
}
_SPLIT_KEYS = {"val_fraction", "test_fraction", "seed"}


@dataclass(frozen=True)
class DeviceData:
    source: str = "partition"
    dataset: str = ""
    partition_file: str = ""
    client: int = 0
    data_dir: str | None = None
    path: str = ""
    resize: bool = False
    entry: str = ""
    args: Any = None
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.client < 0:
            raise ConfigError(f"client must be >= 0, got {self.client}")
        if self.source == "partition" and self.dataset not in DATASET_NAMES:
            raise ConfigError(f"dataset {self.dataset!r} is not one of {', '.join(DATASET_NAMES)}")
        if self.source in ("folder", "arrays") and not self.path:
            raise ConfigError(f"source = \"{self.source}\" needs path = \"...\" (or --data PATH)")
        if self.source == "python" and not ENTRY_POINT.fullmatch(self.entry):
            raise ConfigError(f"source = \"python\" needs entry = \"package.module:function\", got {self.entry!r}")
        if self.args is not None and not isinstance(self.args, dict):
            raise ConfigError(f"args must be a table of keyword arguments, got {self.args!r}")
        if not 0 < self.test_fraction < 1 or not 0 <= self.val_fraction < 1 or \
                self.test_fraction + self.val_fraction >= 1:
            raise ConfigError(f"test_fraction in (0, 1), val_fraction in [0, 1) and their sum < 1; got "
                              f"{self.test_fraction} and {self.val_fraction}")


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
    unknown = sorted(set(raw) - {"credentials", "python_path", "data", "edge", "privacy"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) or table(s) {', '.join(unknown)}; known: credentials, "
                          f"python_path, [data], [edge], [privacy]")
    if not isinstance(raw.get("privacy", {}), dict):
        raise ConfigError(f"{path}: [privacy] must be a table (device_budget, delta)")
    privacy = from_mapping(DevicePrivacy, raw.get("privacy", {}), f"{path} [privacy]")
    creds = raw.get("credentials")
    if not isinstance(creds, str) or not creds:
        raise ConfigError(f"{path}: credentials = \"PATH\" (the file 'flayer broker add-device' wrote) is required")
    tables: dict[str, dict[str, Any]] = {k: dict(raw.get(k, {})) for k in ("data", "edge")}
    for table, values in (overrides or {}).items():
        tables.setdefault(table, {}).update({k: v for k, v in values.items() if v is not None})
    data_table = tables["data"]
    if "data_path" in data_table:  # --data: the source's folder or file (a partition's data set folder)
        value = data_table.pop("data_path")
        data_table["data_dir" if _source_of(data_table) == "partition" else "path"] = value
    source = _source_of(data_table)
    if source not in SOURCES:
        raise ConfigError(f"{path} [data]: source must be one of {', '.join(SOURCES)}, got {source!r}")
    misplaced = sorted(set(data_table) - _SOURCE_KEYS[source] - _SPLIT_KEYS - {"source"})
    if misplaced and all(k in set().union(*_SOURCE_KEYS.values()) for k in misplaced):
        raise ConfigError(f"{path} [data]: key(s) {', '.join(misplaced)} do not apply to source = \"{source}\" "
                          f"(its keys: {', '.join(sorted(_SOURCE_KEYS[source] | _SPLIT_KEYS))})")
    if source == "partition":
        missing = sorted({"dataset", "partition_file", "client"} - set(data_table))
        if missing:
            raise ConfigError(f"{path} [data]: missing key(s) {', '.join(missing)} (or set source = \"folder\", "
                              f"\"arrays\" or \"python\" for the device's own data)")
    base = path.resolve().parent

    def resolve(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        p = Path(value).expanduser()
        return str((p if p.is_absolute() else base / p).resolve())

    if "python_path" in raw:
        add_python_path(raw["python_path"], base, f"{path}:")
    for table, key in (("data", "data_dir"), ("data", "partition_file"), ("data", "path"), ("edge", "state_dir")):
        if key in tables[table]:
            tables[table][key] = resolve(tables[table][key])
    data = from_mapping(DeviceData, tables["data"], f"{path} [data]")
    own = {k: v for k, v in (("device_budget", privacy.device_budget), ("device_delta", privacy.delta),
                             ("secure_corrupt_fraction", privacy.secure_corrupt_fraction),
                             ("max_participations", privacy.max_participations),
                             ("min_separation", privacy.min_separation),
                             ("privacy_require", parse_require(privacy.require))) if v}
    edge = from_mapping(EdgeSettings, {**tables["edge"], **own, "client_index": data.client}, f"{path} [edge]")
    return DeviceConfig(Path(resolve(creds)), data, edge)


def _source_of(table: Mapping[str, Any]) -> Any:
    return table.get("source", "partition")


def load_device_data(data: DeviceData) -> Any:
    """This device's data: for a partition, its :class:`flayer.train.ClientData` (the data set and the
    saved partition, checked against the data set's fingerprint); for its own data, a
    :class:`edge_client.sources.DeviceSource` checked as far as it can be before the first plan."""
    if data.source != "partition":
        from edge_client.sources import DeviceSource, SourceConfig, check_source

        cfg = SourceConfig(data.source, data.path, data.entry, data.args, data.resize, data.val_fraction,
                           data.test_fraction, data.seed)
        check_source(cfg)
        return DeviceSource(cfg)
    from flayer.data import load_dataset
    from flayer.partition import PartitionError, load_partition
    from flayer.train import client_data

    ds = load_dataset(data.dataset, data.data_dir)
    part = load_partition(data.partition_file, len(ds), ds.fingerprint())
    if data.client >= part.num_clients:
        raise PartitionError(f"client {data.client} is not in {data.partition_file} "
                             f"({part.num_clients} clients: 0..{part.num_clients - 1})")
    return client_data(ds, part.clients[data.client])
