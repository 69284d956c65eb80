"""``flayer emulate --virtual``: the fleet of an emulate config on a simulated clock (emulator.virtual).

Same config, profiles, mix, trace and seed as ``flayer emulate``, so the devices have the same
availability timelines; writes ``summary.json`` (per profile: trained, accepted, refused, lost;
accuracy over simulated time; final personal accuracy) and ``rounds.jsonl`` under the output folder.

What it honours of the config: the round settings of ``[federation]`` (asynchronous ``"auto"``
values resolved for the fleet as ``flayer emulate`` resolves them), what crosses the links
(``value_codec``, ``compress``, ``delta_downloads``, ``fit_lowest_codec``, ``fit_min_keep``,
``max_update_bytes``; ``[edge] upload``, ``error_feedback``, ``uplink_kbps``, ``max_update_bytes``:
:func:`thin_links`), the profiles, mix and trace. What has no meaning in one process without a broker
(:data:`IGNORED`: worker processes, network threads, the broker, the devices' MQTT timings) is named in
a warning when the config file sets it; the command line refuses those flags (cli.emulate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from cli.common import CliError, load_data, set_threads, write_json
from cli.report import table

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
    from flayer.config import read_toml

    raw = read_toml(config)
    return [f"[{t}] {k}" for t, keys in IGNORED.items() for k in keys if isinstance(raw.get(t), dict) and k in raw[t]]


def timing_of(cfg: Any, n: int, args: argparse.Namespace) -> Any:
    from coordinator.config import FederationSettings
    from emulator.options import federation_table
    from emulator.virtual import FleetTiming
    from flayer.config import ConfigError, from_mapping

    try:
        fed = from_mapping(FederationSettings, {**federation_table(cfg, n), "credentials": "virtual"},
                           "[federation]")
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    for name in ("budget", "sample_cost"):
        v = getattr(args, name, None)
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise CliError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    asynchronous = fed.resolve_async(n)[0]  # as the emulator's coordinator resolves "auto" (emulator.options)
    limits = [x for x in (fed.max_update_bytes, cfg.edge.max_update_bytes) if x > 0]
    return FleetTiming(fed.mode, fed.quorum, fed.over_selection, fed.min_devices, fed.deadline_s, fed.grace_s,
                       fed.max_samples, args.budget or math.inf, args.sample_cost, asynchronous,
                       uplink_kbps=cfg.edge.uplink_kbps, max_update_bytes=min(limits) if limits else 0)


def thin_links(cfg: Any, n: int, initial: Any) -> Any:
    """What crosses the simulated links for this config (:class:`cli.thinsim.ThinLinks`): the plan's value
    codec and zstd, the devices' error feedback and fitted uploads within the coordinator's cap, and the
    coordinator's delta downloads."""
    from cli.thinsim import ThinLinks, ThinOptions
    from coordinator.config import FederationSettings
    from emulator.options import federation_table
    from flayer.config import from_mapping
    from protocol.upload_cap import UploadCap

    fed = from_mapping(FederationSettings, {**federation_table(cfg, n), "credentials": "virtual"}, "[federation]")
    try:
        opts = ThinOptions(fed.value_codec, 1.0, cfg.edge.error_feedback, fed.delta_downloads, fed.compress,
                           fit=cfg.edge.upload == "fit", cap=UploadCap(fed.fit_lowest_codec, fed.fit_min_keep))
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    return ThinLinks(opts, initial)


def run_virtual_fleet(cfg: Any, args: argparse.Namespace) -> int:
    from emulator.availability import device_timeline, load_trace
    from emulator.fleet import device_ids
    from emulator.profiles import assign_profiles, load_profiles, parse_mix
    from emulator.virtual import run_virtual
    from flayer.config import ConfigError
    from flayer.strategies import make_strategy
    from flayer.train import client_data, pick_device

    run_cfg, emu = cfg.run, cfg.emulator
    set_threads(run_cfg)
    try:
        profiles = load_profiles(emu.profiles)
        if emu.mix:
            profiles = profiles.with_mix(parse_mix(emu.mix, profiles.profiles))
        prepared = load_data(run_cfg)
        n = len(prepared.partition.clients)
        ids = device_ids(n)
        assigned = assign_profiles(n, profiles.mix, run_cfg.seed)
        trace = load_trace(emu.trace, ids, emu.trace_scale) if emu.trace else None
        timing = timing_of(cfg, n, args)
        spec = prepared.dataset.model_spec(run_cfg.data.model)
        strategy = make_strategy(run_cfg.strategy, spec, run_cfg.train, run_cfg.options())
    except (ConfigError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    timelines = [device_timeline(profiles.profiles[assigned[i]], run_cfg.seed, ids[i],
                                 trace.get(ids[i]) if trace is not None else None) for i in range(n)]
    from flayer.engine import initial_global_state

    links = thin_links(cfg, n, initial_global_state(strategy, run_cfg.seed))
    clients = [client_data(prepared.dataset, c) for c in prepared.partition.clients]
    out = Path(args.out or run_cfg.out or f"runs/virtual-{timing.mode}-{run_cfg.strategy}-"
                                          f"{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"virtual fleet: {n} devices, {timing.mode} rounds, up to {run_cfg.rounds} versions"
          + (f" or {timing.budget_s:g} simulated seconds" if math.isfinite(timing.budget_s) else ""),
          file=sys.stderr)
    o = links.opts
    print(f"links: uploads {o.value_codec}{' + zstd' if o.zstd else ''}"
          f"{', fitted to each uplink' if o.fit else ''}{', error feedback' if o.error_feedback else ''}; "
          f"downloads {'deltas ' + o.delta_downloads if o.delta_downloads != 'off' else 'the whole model'}",
          file=sys.stderr)
    if timing.mode == "async":
        a = timing.asynchronous
        print(f"async: buffer {a.buffer}, max_staleness {a.max_staleness}, concurrency {a.concurrency}",
              file=sys.stderr)
    ignored = ignored_keys(args.config)
    if ignored:
        print(f"warning: --virtual does not simulate {', '.join(ignored)} (no broker, no MQTT, one process); "
              f"{'they are' if len(ignored) > 1 else 'it is'} ignored", file=sys.stderr)
    try:
        res = run_virtual(strategy, clients, [profiles.profiles[a] for a in assigned], ids, timelines,
                          run_cfg.rounds, run_cfg.seed, timing, device=pick_device(run_cfg.train.device), links=links)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    summary = virtual_summary(res, timing, run_cfg, links)
    with open(out / "rounds.jsonl", "w") as fh:
        for r in res.rounds:
            fh.write(json.dumps(r) + "\n")
    write_json(out / "summary.json", summary)
    rows = [(p, c.get("devices", 0), c.get("trained", 0), c.get("accepted", 0),
             c.get("late", 0) + c.get("stale", 0), c.get("lost", 0),
             "-" if c["accepted_share"] is None else f"{c['accepted_share']:.2f}",
             f"{c.get('bytes_up', 0) / 1e6:.1f}", f"{c.get('bytes_down', 0) / 1e6:.1f}") for p, c in res.profiles.items()]
    print(table(["profile", "devices", "trained", "accepted", "late/stale", "lost", "accepted share", "MB up",
                 "MB down"], rows))
    last = res.rounds[-1] if res.rounds else None
    print(f"\n{len(res.rounds)} versions in {last['t'] if last else 0:.0f} simulated s; last global acc "
          f"{last['acc'] if last else 0:.4f}; personal models {res.final_acc:.4f}; {res.cpu_s:.0f} CPU s "
          f"(outputs in {out}/)")
    return 0


def virtual_summary(res: Any, timing: Any, run_cfg: Any, links: Any = None) -> dict[str, Any]:
    return {"mode": timing.mode, "strategy": run_cfg.strategy, "seed": run_cfg.seed, "versions": len(res.rounds),
            "simulated_s": res.rounds[-1]["t"] if res.rounds else 0.0, "final_personal_acc": res.final_acc,
            "final_client_acc": res.final_client_acc, "acc": [r["acc"] for r in res.rounds],
            "t": [r["t"] for r in res.rounds], "profiles": res.profiles, "cpu_s": res.cpu_s,
            "timing": {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                       for k, v in dataclasses.asdict(timing).items()},
            "links": dataclasses.asdict(links.opts) if links is not None else None}
