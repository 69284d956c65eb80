"""``flayer emulate --virtual``: the fleet of an emulate config on a simulated clock (emulator.virtual).

Same config, profiles, mix, trace and seed as ``flayer emulate``, so the devices have the same
availability timelines; writes ``summary.json`` (per profile: trained, accepted, refused, lost;
accuracy over simulated time; final personal accuracy) and ``rounds.jsonl`` under the output folder.

What it honours of the config: the round settings of ``[federation]`` (asynchronous ``"auto"``
values resolved for the fleet as ``flayer emulate`` resolves them), what crosses the links
(``value_codec``, ``compress``, ``delta_downloads``, ``fit_lowest_codec``, ``fit_min_keep``,
``max_update_bytes``; ``[edge] upload``, ``error_feedback``, ``uplink_kbps``, ``max_update_bytes``:
emulator.virtual_config), the profiles, mix and trace. What has no meaning in one process without a broker
(emulator.virtual_config.IGNORED: worker processes, network threads, the broker, the devices' MQTT timings) is named in
a warning when the config file sets it; the command line refuses those flags (cli.emulate).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from cli.common import CliError, load_data, set_threads, write_json
from cli.report import table
from emulator.virtual_config import ignored_keys, thin_links, timing_of, virtual_summary


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
        timing = timing_of(cfg, n, args.budget, args.sample_cost)
        spec = prepared.dataset.model_spec(run_cfg.data.model)
        strategy = make_strategy(run_cfg.strategy, spec, run_cfg.train, run_cfg.options()).keep_blank()
    except (ConfigError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    timelines = [device_timeline(profiles.profiles[assigned[i]], run_cfg.seed, ids[i],
                                 trace.get(ids[i]) if trace is not None else None) for i in range(n)]
    from flayer.engine import initial_global_state

    try:
        links = thin_links(cfg, n, initial_global_state(strategy, run_cfg.seed))
    except (ConfigError, ValueError) as exc:
        raise CliError(str(exc)) from exc
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
