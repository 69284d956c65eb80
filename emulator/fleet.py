"""The fleet one launcher hosts: ``fleet.json`` in its output folder, read by its worker processes.

Everything a worker needs to build its devices without asking anyone: device ids (device ``i`` is
client ``i`` of the partition file), each device's profile, the data set, the credentials folder,
the broker address, the edge settings, the availability trace if any, and how the devices are
spread over shards and workers.

Sharding (``--shard i/n``): device ``k`` belongs to shard ``k % n`` (interleaved, so every shard
gets its share of every profile); inside a shard, the j-th of its devices goes to worker ``j % W``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_client.config import EdgeSettings
from flayer.config import ConfigError, from_mapping
from protocol.messages import DEVICE_LABEL

from .profiles import DeviceProfile

__all__ = [
    "NETWORK_MODES",
    "THREAD_MODE_LIMIT",
    "FleetSpec",
    "device_ids",
    "parse_shard",
    "shard_indices",
    "worker_indices",
]

NETWORK_MODES = ("auto", "thread", "shared")
# paho's own thread waits in select(), which cannot watch descriptors >= 1024; each client holds
# three (its socket and a wake-up pair), so one process fits about 330 -- keep a margin
THREAD_MODE_LIMIT = 250


def device_ids(n: int, prefix: str = "dev") -> list[str]:
    width = max(3, len(str(n - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(n)]


def parse_shard(text: str) -> tuple[int, int]:
    """``i/n`` -> (i, n) with 0 <= i < n."""
    a, sep, b = text.partition("/")
    try:
        i, n = int(a), int(b)
    except ValueError:
        raise ConfigError(f"--shard {text!r}: expected i/n, e.g. 0/2 (this machine hosts shard i of n)") \
            from None
    if not sep or n < 1 or not 0 <= i < n:
        raise ConfigError(f"--shard {text!r}: need 0 <= i < n")
    return i, n


def shard_indices(n_devices: int, shard: int, shards: int) -> list[int]:
    return [k for k in range(n_devices) if k % shards == shard]


def worker_indices(indices: Sequence[int], worker: int, workers: int) -> list[int]:
    return list(indices[worker::workers])


@dataclass(frozen=True)
class FleetSpec:
    federation: str
    devices: tuple[str, ...]
    profile_of: tuple[str, ...]  # profile name per device
    profiles: Mapping[str, DeviceProfile]
    seed: int
    dataset: str
    partition_file: str
    credentials_dir: str
    state_root: str  # devices' state folders: <state_root>/<id>
    events_dir: str
    edge: EdgeSettings  # state_dir and client_index are set per device
    shard: int = 0
    shards: int = 1
    workers: int = 1
    network: str = "thread"
    model_slots: int = 0  # devices per worker holding a model at once (emulator.slots); 0 = no bound
    data_dir: str | None = None
    broker_host: str | None = None  # overrides the credentials files' address (--broker URL)
    broker_port: int | None = None
    trace: Mapping[str, Sequence[tuple[float, float]]] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.profile_of):
            raise ConfigError("one profile per device")
        missing = sorted(set(self.profile_of) - set(self.profiles))
        if missing:
            raise ConfigError(f"devices use unknown profile(s) {', '.join(missing)}")
        if self.network not in ("thread", "shared"):
            raise ConfigError(f"network must be thread or shared, got {self.network!r}")
        if not 0 <= self.shard < self.shards or self.workers < 1:
            raise ConfigError("need 0 <= shard < shards and workers >= 1")
        if self.model_slots < 0:
            raise ConfigError(f"model_slots must be >= 0 (0 = no bound), got {self.model_slots}")

    def mine(self) -> list[int]:
        """Indices of the devices this launcher (shard) hosts."""
        return shard_indices(len(self.devices), self.shard, self.shards)

    def of_worker(self, worker: int) -> list[int]:
        return worker_indices(self.mine(), worker, self.workers)

    def edge_settings(self, index: int) -> EdgeSettings:
        profile = self.profile_of[index]  # the device's label in the coordinator's metrics, unless [edge] sets one
        return dataclasses.replace(self.edge, client_index=index,
                                   state_dir=str(Path(self.state_root) / self.devices[index]),
                                   label=self.edge.label or (profile if DEVICE_LABEL.fullmatch(profile) else ""))

    def events_file(self, worker: int) -> Path:
        return Path(self.events_dir) / f"worker-{self.shard}-{worker}.jsonl"

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["profiles"] = {k: dataclasses.asdict(v) for k, v in self.profiles.items()}
        d["trace"] = None if self.trace is None else {k: [list(x) for x in v] for k, v in self.trace.items()}
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FleetSpec:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: unreadable fleet file ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a fleet file")
        try:
            data["profiles"] = {k: from_mapping(DeviceProfile, v, f"{path} profiles.{k}")
                                for k, v in data["profiles"].items()}
            data["edge"] = from_mapping(EdgeSettings, data["edge"], f"{path} edge")
            data["devices"], data["profile_of"] = tuple(data["devices"]), tuple(data["profile_of"])
            if data.get("trace") is not None:
                data["trace"] = {k: [(float(a), float(b)) for a, b in v] for k, v in data["trace"].items()}
            return from_mapping(cls, data, str(path))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{path}: malformed fleet file ({exc!r})") from None
