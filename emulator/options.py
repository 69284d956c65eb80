"""What ``flayer emulate`` runs: the run tables of ``flayer simulate`` plus three of its own.

An emulate config file (``configs/emulate-demo.toml``) holds ``[run]``, ``[data]``, ``[train]`` and
``[strategy.<name>]`` as for ``flayer simulate`` (``[data] clients`` is the number of devices), and:

- ``[federation]``: the coordinator's settings (``quorum``, ``over_selection``, ``min_devices``,
  ``deadline_s``, ``grace_s``, ``value_codec``, ...; see ``flayer coordinator``), except
  ``credentials`` and ``state_dir``, which the emulator sets;
- ``[edge]``: the devices' settings (``heartbeat_s``, ``ack_timeout_s``, ``retries``, ...; see
  ``flayer edge``), except ``state_dir``, which the emulator sets;
- ``[emulator]``: ``profiles`` (a profiles file, relative to the config file), ``mix``
  (``NAME=SHARE,...``), ``workers`` (processes hosting the devices; 0 = one per core), ``network``
  (``auto``, ``thread``, ``shared``), ``trace`` (availability CSV, relative to the config file),
  ``trace_scale``, ``federation`` (its name on the broker), ``broker_kind`` (``auto``, ``mosquitto``,
  ``embedded``), ``timeout_s`` (give up after this long; 0 = never), ``http_models`` (serve the global
  model and its deltas over HTTP: the emulator starts nginx on the coordinator's ``models_dir``, and
  the devices fetch from it instead of the broker's chunks; docs/howto/http-models.md).

Command-line flags override the file; every key is checked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config import FederationSettings
from edge_client.config import EdgeSettings
from flayer.config import ConfigError, RunConfig, from_mapping, load_run_config, read_toml
from flayer.engine.secure_plan import MIN_COHORT
from flayer.spec import ENTRY_POINT

from .slots import DEFAULT_MODEL_SLOTS

__all__ = ["DEFAULT_EDGE", "EmulateConfig", "EmulatorSettings", "load_emulate_config"]

RUN_TABLES = ("run", "data", "train", "strategy", "privacy")
# devices of an emulated fleet report often: the coordinator sees who is online within seconds
DEFAULT_EDGE: dict[str, Any] = {"heartbeat_s": 5.0, "ack_timeout_s": 30.0, "device": "cpu", "threads": 1,
                                "amp": False}


@dataclass(frozen=True)
class EmulatorSettings:
    profiles: str | None = None  # a profiles file, relative to the config file (built-ins without it)
    mix: str | None = None  # NAME=SHARE,... share of the fleet per profile (default: the profiles' [mix])
    workers: int = 0  # processes hosting the devices; 0 = one per core
    network: str = "auto"  # a paho thread per device, or one shared thread per worker (auto: above 250)
    trace: str | None = None  # availability trace CSV (device_id,start_s,end_s), relative to the config file
    trace_scale: float = 1.0  # trace seconds per second of the run
    federation: str = "emu"  # the federation's name on the broker
    broker_kind: str = "auto"  # the broker the emulator starts: auto (mosquitto when installed), mosquitto, embedded
    timeout_s: float = 0.0  # give up after this long; 0 = never
    model_slots: int = DEFAULT_MODEL_SLOTS  # devices per worker holding a model at once (emulator.slots); 0 = no bound
    http_models: bool = False  # serve models and deltas over HTTP: nginx on the coordinator's models_dir for the run

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0 (0 = one per core), got {self.workers}")
        if self.network not in ("auto", "thread", "shared"):
            raise ConfigError(f"network must be auto, thread or shared, got {self.network!r}")
        if self.broker_kind not in ("auto", "mosquitto", "embedded"):
            raise ConfigError(f"broker_kind must be auto, mosquitto or embedded, got {self.broker_kind!r}")
        if not (self.trace_scale > 0 and math.isfinite(self.trace_scale)):
            raise ConfigError(f"trace_scale must be > 0, got {self.trace_scale}")
        if not self.timeout_s >= 0:
            raise ConfigError(f"timeout_s must be >= 0, got {self.timeout_s}")
        if self.model_slots < 0:
            raise ConfigError(f"model_slots must be >= 0 (0 = no bound), got {self.model_slots}")


@dataclass(frozen=True)
class EmulateConfig:
    run: RunConfig
    federation: Mapping[str, Any]  # [federation] keys (validated), without credentials/state_dir
    edge: EdgeSettings  # state_dir / client_index are set per device
    emulator: EmulatorSettings
    source: str = "flags"
    extra: Mapping[str, Any] = field(default_factory=dict)


def _relative(base: Path | None, value: str | None) -> str | None:
    if value is None or base is None:
        return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def load_emulate_config(path: str | Path | None, overrides: Mapping[str, Mapping[str, Any]]) -> EmulateConfig:
    """Read ``path`` (optional) and apply ``overrides`` (tables as in the file; None values ignored)."""
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    src = str(path) if path is not None else "flags"
    unknown = sorted(set(raw) - {*RUN_TABLES, "federation", "edge", "emulator"})
    if unknown:
        raise ConfigError(f"{src}: unknown table(s) {', '.join(unknown)}; known: run, data, train, strategy, "
                          f"privacy, federation, edge, emulator")
    base = Path(path).resolve().parent if path is not None else None

    def merged(table: str) -> dict[str, Any]:
        values = dict(raw.get(table, {}))
        if not isinstance(raw.get(table, {}), dict):
            raise ConfigError(f"{src}: [{table}] must be a table")
        values.update({k: v for k, v in overrides.get(table, {}).items() if v is not None})
        return values

    run_tables: dict[str, Any] = {t: raw.get(t, {}) for t in RUN_TABLES}
    for table in RUN_TABLES:
        extra = overrides.get(table, {})
        if table == "strategy":
            for name, opts in extra.items():
                run_tables["strategy"] = {**run_tables["strategy"],
                                          name: {**run_tables["strategy"].get(name, {}), **opts}}
        else:
            run_tables[table] = {**run_tables[table], **{k: v for k, v in extra.items() if v is not None}}
    try:
        run = load_run_config(None, run_tables)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("flags", src, 1)) from None
    fed = merged("federation")
    taken = sorted({"credentials", "state_dir"} & set(fed))
    if taken:
        raise ConfigError(f"{src} [federation]: {', '.join(taken)} are set by the emulator; leave them out")
    check = {**fed, "credentials": "set-by-the-emulator"}
    if "quorum" in fed:  # an unset min_devices is the quorum, as federation_table sets it (not the class's 1)
        check.setdefault("min_devices", fed["quorum"])
    from_mapping(FederationSettings, check, f"{src} [federation]")
    edge_values = merged("edge")
    if "state_dir" in edge_values or "client_index" in edge_values:
        raise ConfigError(f"{src} [edge]: state_dir and client_index are set per device by the emulator")
    if run.data.model and ENTRY_POINT.fullmatch(run.data.model):  # the fleet's own model: its devices agree to it
        allowed = list(edge_values.get("allow_entry_points") or ())
        edge_values["allow_entry_points"] = [*allowed, *([] if run.data.model in allowed else [run.data.model])]
    edge = from_mapping(EdgeSettings, {**DEFAULT_EDGE, **edge_values}, f"{src} [edge]")
    emu_values = merged("emulator")
    for key in ("profiles", "trace"):
        if key in raw.get("emulator", {}) and key not in {k for k, v in overrides.get("emulator", {}).items()
                                                          if v is not None}:
            emu_values[key] = _relative(base, raw["emulator"][key])
    emu = from_mapping(EmulatorSettings, emu_values, f"{src} [emulator]")
    # secure rounds: an unset secure_dropout is chosen from the fleet's profiles (emulator.launcher)
    given = "secure_dropout" in run_tables["privacy"]
    return EmulateConfig(run, fed, edge, emu, src, extra={"secure_dropout_given": given})


def federation_table(cfg: EmulateConfig, n_devices: int) -> dict[str, Any]:
    """The coordinator's [federation] values with the emulator's defaults: quorum = half the fleet (at least 3 with
    secure rounds),
    over-selection 1.3, min_devices = quorum, a 120 s deadline; asynchronous ``"auto"`` values that
    depend on the fleet's size (:func:`flayer.engine.versions.resolve_async`) resolved for it, so the
    emulator's coordinator and ``--virtual`` run the same settings."""
    fed = dict(cfg.federation)
    quorum = max(1, math.ceil(n_devices / 2))
    if cfg.run.privacy.secure_aggregation:  # devices refuse a secure round over fewer (flayer.engine.secure_plan)
        quorum = max(quorum, min(MIN_COHORT, n_devices))
    fed.setdefault("quorum", quorum)
    fed.setdefault("min_devices", fed["quorum"])
    fed.setdefault("over_selection", 1.3)
    fed.setdefault("deadline_s", 120.0)
    fed.setdefault("grace_s", 3.0)
    if fed["min_devices"] > n_devices:
        raise ConfigError(f"[federation] min_devices {fed['min_devices']} exceeds the fleet "
                          f"({n_devices} devices)")
    if fed.get("mode") == "async":  # "auto" settings that depend on the fleet, resolved for this one
        settings = from_mapping(FederationSettings, {**fed, "credentials": "set-by-the-emulator"}, "[federation]")
        known, blind = settings.resolve_async(n_devices)[0], settings.resolve_async()[0]
        if known != blind:
            fed["max_staleness"], fed["concurrency"] = known.max_staleness, known.concurrency
    return fed


def edge_dict(edge: EdgeSettings) -> dict[str, Any]:
    return dataclasses.asdict(edge)
