"""``flayer emulate --virtual``: the fleet of an emulate config on a simulated clock (emulator.virtual).

Same config, profiles, mix, trace and seed as ``flayer emulate``, so the devices have the same
availability timelines; writes ``summary.json`` (per profile: trained, accepted, refused, lost;
accuracy over simulated time; final personal accuracy) and ``rounds.jsonl`` under the output folder.
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
    return FleetTiming(fed.mode, fed.quorum, fed.over_selection, fed.min_devices, fed.deadline_s, fed.grace_s,
                       fed.max_samples, args.budget or math.inf, args.sample_cost, fed.async_settings)


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
    clients = [client_data(prepared.dataset, c) for c in prepared.partition.clients]
    out = Path(args.out or run_cfg.out or f"runs/virtual-{timing.mode}-{run_cfg.strategy}-"
                                          f"{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"virtual fleet: {n} devices, {timing.mode} rounds, up to {run_cfg.rounds} versions"
          + (f" or {timing.budget_s:g} simulated seconds" if math.isfinite(timing.budget_s) else ""),
          file=sys.stderr)
    try:
        res = run_virtual(strategy, clients, [profiles.profiles[a] for a in assigned], ids, timelines,
                          run_cfg.rounds, run_cfg.seed, timing, device=pick_device(run_cfg.train.device))
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    summary = virtual_summary(res, timing, run_cfg)
    with open(out / "rounds.jsonl", "w") as fh:
        for r in res.rounds:
            fh.write(json.dumps(r) + "\n")
    write_json(out / "summary.json", summary)
    rows = [(p, c.get("devices", 0), c.get("trained", 0), c.get("accepted", 0),
             c.get("late", 0) + c.get("stale", 0), c.get("lost", 0),
             "-" if c["accepted_share"] is None else f"{c['accepted_share']:.2f}") for p, c in res.profiles.items()]
    print(table(["profile", "devices", "trained", "accepted", "late/stale", "lost", "accepted share"], rows))
    last = res.rounds[-1] if res.rounds else None
    print(f"\n{len(res.rounds)} versions in {last['t'] if last else 0:.0f} simulated s; last global acc "
          f"{last['acc'] if last else 0:.4f}; personal models {res.final_acc:.4f}; {res.cpu_s:.0f} CPU s "
          f"(outputs in {out}/)")
    return 0


def virtual_summary(res: Any, timing: Any, run_cfg: Any) -> dict[str, Any]:
    return {"mode": timing.mode, "strategy": run_cfg.strategy, "seed": run_cfg.seed, "versions": len(res.rounds),
            "simulated_s": res.rounds[-1]["t"] if res.rounds else 0.0, "final_personal_acc": res.final_acc,
            "final_client_acc": res.final_client_acc, "acc": [r["acc"] for r in res.rounds],
            "t": [r["t"] for r in res.rounds], "profiles": res.profiles, "cpu_s": res.cpu_s,
            "timing": {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                       for k, v in dataclasses.asdict(timing).items()}}
