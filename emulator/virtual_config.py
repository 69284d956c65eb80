"""What ``flayer emulate --virtual`` takes from an emulate config (emulator.virtual runs it): the round
settings (:func:`timing_of`, asynchronous ``"auto"`` values resolved as the emulator's coordinator resolves
them), what crosses the simulated links (:func:`thin_links`), the keys it does not simulate
(:data:`IGNORED`) and the run's ``summary.json`` (:func:`virtual_summary`). Errors are ConfigError."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from flayer.config import ConfigError, from_mapping, read_toml
from protocol.upload_cap import UploadCap

from .options import federation_table
from .thinsim import ThinLinks, ThinOptions
from .virtual import FleetTiming

__all__ = ["IGNORED", "ignored_keys", "thin_links", "timing_of", "virtual_summary"]

# config keys --virtual does not simulate: no broker, no MQTT, one process (module docstring)
IGNORED: dict[str, tuple[str, ...]] = {
    "emulator": ("workers", "network", "federation", "broker_kind", "timeout_s"),
    "edge": ("heartbeat_s", "ack_timeout_s", "retries", "backoff_s", "backoff_max_s", "download_stall_s",
             "exit_when_finished", "runtime", "amp", "threads"),
    "federation": ("min_updates", "extend_s", "max_malformed", "queue_bytes", "queue_sender_bytes"),
}


def ignored_keys(config: str | Path | None) -> list[str]:
    """``[table] key`` of each key the config file sets that --virtual does not simulate (:data:`IGNORED`)."""
    if config is None:
        return []
    raw = read_toml(config)
    return [f"[{t}] {k}" for t, keys in IGNORED.items() for k in keys if isinstance(raw.get(t), dict) and k in raw[t]]


def timing_of(cfg: Any, n: int, budget: float | None = None, sample_cost: float | None = None) -> FleetTiming:
    """The simulated fleet's round settings (ConfigError naming what is out of range)."""
    from coordinator.config import FederationSettings

    fed = from_mapping(FederationSettings, {**federation_table(cfg, n), "credentials": "virtual"}, "[federation]")
    for name, v in (("budget", budget), ("sample_cost", sample_cost)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    asynchronous = fed.resolve_async(n)[0]  # as the emulator's coordinator resolves "auto" (emulator.options)
    limits = [x for x in (fed.max_update_bytes, cfg.edge.max_update_bytes) if x > 0]
    return FleetTiming(fed.mode, fed.quorum, fed.over_selection, fed.min_devices, fed.deadline_s, fed.grace_s,
                       fed.max_samples, budget or math.inf, sample_cost, asynchronous,
                       uplink_kbps=cfg.edge.uplink_kbps, max_update_bytes=min(limits) if limits else 0)


def thin_links(cfg: Any, n: int, initial: Any) -> ThinLinks:
    """What crosses the simulated links for this config (:class:`emulator.thinsim.ThinLinks`): the plan's value
    codec and zstd, the devices' error feedback and fitted uploads within the coordinator's cap, and the
    coordinator's delta downloads."""
    from coordinator.config import FederationSettings

    fed = from_mapping(FederationSettings, {**federation_table(cfg, n), "credentials": "virtual"}, "[federation]")
    try:
        opts = ThinOptions(fed.value_codec, 1.0, cfg.edge.error_feedback, fed.delta_downloads, fed.compress,
                           fit=cfg.edge.upload == "fit", cap=UploadCap(fed.fit_lowest_codec, fed.fit_min_keep))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return ThinLinks(opts, initial)


def virtual_summary(res: Any, timing: Any, run_cfg: Any, links: Any = None) -> dict[str, Any]:
    return {"mode": timing.mode, "strategy": run_cfg.strategy, "seed": run_cfg.seed, "versions": len(res.rounds),
            "simulated_s": res.rounds[-1]["t"] if res.rounds else 0.0, "final_personal_acc": res.final_acc,
            "final_client_acc": res.final_client_acc, "acc": [r["acc"] for r in res.rounds],
            "t": [r["t"] for r in res.rounds], "profiles": res.profiles, "cpu_s": res.cpu_s,
            "timing": {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                       for k, v in dataclasses.asdict(timing).items()},
            "links": dataclasses.asdict(links.opts) if links is not None else None}
