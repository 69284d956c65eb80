"""The emulator's outputs beside the coordinator's own ``coordinator/metrics.jsonl``:

- ``metrics.jsonl``: the metrics schema (:mod:`protocol.metrics_schema`), written as the run goes:
  the coordinator's round records with bytes counted over the devices' emulated links;
- ``rounds.jsonl``: per round, selected, reported (accepted), devices online when it opened and
  closed, accuracy, MB up and down over the devices' emulated links, the coordinator's MB in,
  rejections, wall time and why it closed;
- ``devices.jsonl``: per device, profile, lifetimes, crashes, trained rounds (those it reported and those
  whose update was accepted: :meth:`emulator.progress.DeviceView.trained_rounds`), accepted updates (one
  per acknowledged round), CPU seconds of its local rounds and the seconds its profile's slowdown added,
  final personal accuracy;
- ``summary.json``: the fleet, the timings, totals and per-worker memory, threads and connections.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fleet import FleetSpec
    from .progress import FleetProgress

__all__ = ["FleetResult", "device_rows", "emulate_round_record", "profile_rows", "write_outputs"]


@dataclass
class FleetResult:
    """What a fleet run (emulator.launcher.run_fleet) leaves: its folder, its fleet, what was seen of it."""

    out: Path
    spec: FleetSpec
    progress: FleetProgress
    rows: list[dict[str, Any]]
    setup_s: float
    run_s: float
    broker: str
    finished: bool
    exits: dict[str, int | None] = field(default_factory=dict)


def emulate_round_record(rec: dict[str, Any], opened: dict[str, Any], online_close: int | None,
                         link: tuple[int, int]) -> dict[str, Any]:
    """The coordinator's ``round`` record as the emulator's: source ``emulate``, bytes up and down as the
    devices moved them over their emulated links (re-sends included) by the time the round closed, and the
    devices online when it opened and closed."""
    from protocol.metrics_schema import ACC_DEFINITIONS, upgrade

    base = upgrade(rec, f"the coordinator's record of round {rec.get('round')}")
    out = {**base, "source": "emulate", "acc_definition": ACC_DEFINITIONS["emulate"], "bytes_up": int(link[0]),
           "bytes_down": int(link[1]), "coordinator_bytes_in": base["bytes_up"],
           "coordinator_bytes_out": base["bytes_down"], "online_open": opened.get("online"),
           "online_close": online_close}
    return upgrade(out)


def device_rows(result: FleetResult) -> list[dict[str, Any]]:
    spec, prog = result.spec, result.progress
    mine = set(spec.devices[k] for k in spec.mine())
    rows = []
    for dev in spec.devices:
        if dev not in mine:
            continue
        d = prog.device(dev)
        rows.append({"device": dev, "profile": spec.profile_of[spec.devices.index(dev)], "online": d.online,
                     "offline": d.offline, "crashes": d.crashes, "restarts": d.restarts,
                     "trained": d.trained_rounds(), "accepted": d.accepted, "cpu_s": round(d.cpu_s, 3),
                     "waited_s": round(d.waited_s, 3), "final_acc": d.final_acc, "errors": d.errors})
    return rows


def profile_rows(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per profile: devices, updates trained and accepted, crashes, mean final accuracy."""
    out: dict[str, dict[str, Any]] = {}
    for d in devices:
        p = out.setdefault(d["profile"], {"profile": d["profile"], "devices": 0, "trained": 0, "accepted": 0,
                                          "crashes": 0, "accs": []})
        p["devices"] += 1
        p["trained"] += len(d["trained"])
        p["accepted"] += d["accepted"]
        p["crashes"] += d["crashes"]
        if d["final_acc"] is not None:
            p["accs"].append(d["final_acc"])
    rows = []
    for name in sorted(out):
        p = out[name]
        accs = p.pop("accs")
        rows.append({**p, "mean_final_acc": sum(accs) / len(accs) if accs else None})
    return rows


def write_outputs(result: FleetResult) -> dict[str, Path]:
    out = result.out
    files = {"rounds": out / "rounds.jsonl", "devices": out / "devices.jsonl",
             "summary": out / "summary.json"}
    with open(files["rounds"], "w") as fh:
        fh.writelines(json.dumps(row, sort_keys=True) + "\n" for row in result.rows)
    devices = device_rows(result)
    with open(files["devices"], "w") as fh:
        fh.writelines(json.dumps(row, sort_keys=True) + "\n" for row in devices)
    prog, spec = result.progress, result.spec
    summary = {
        "devices": len(spec.devices), "hosted_here": len(spec.mine()), "shard": f"{spec.shard}/{spec.shards}",
        "workers": spec.workers, "network": spec.network, "broker": result.broker,
        "strategy": spec.extra.get("strategy"),
        "rounds": len(result.rows), "finished": result.finished, "setup_s": round(result.setup_s, 1),
        "run_s": round(result.run_s, 1), "totals": prog.totals(), "profiles": profile_rows(devices),
        "mix": spec.extra.get("mix"),
        "profile_table": {k: dataclasses.asdict(v) for k, v in spec.profiles.items()},
        "peak_rss_mb_per_worker": prog.peak_rss_mb, "max_connected_per_worker": prog.max_connected,
        "final_acc": result.rows[-1]["acc"] if result.rows else None, "exits": result.exits,
        "coordinator": prog.coordinator_done,
    }
    files["summary"].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return files
