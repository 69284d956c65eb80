"""What watching costs: an emulated fleet run twice, without and with the dashboard open.

The same fleet as ``benchmarks/fleet.py`` (FedAvg, FedAvgCNN on Fashion-MNIST iid, every device always on
and unshaped) runs once plainly and once with ``flayer dashboard``'s server started the way ``flayer
emulate --dashboard`` starts it (observer on the broker, tail of the run's metrics file) and a viewer
holding its event stream open (a Server-Sent-Events client in this process, reading every push: the server
works as it would for a browser on another machine). Prints, side by side with their ratio: the mean round
wall time, the CPU seconds of the coordinator process, of the broker and of the launcher process (which
hosts the dashboard), from the first round's opening to the end; and the page's update delay: for each
round, the time from the coordinator closing it (the record's ``time``) to the first pushed snapshot that
holds it.

    python benchmarks/dashboard_cost.py                      # 200 devices, 100 selected, 3 rounds
    python benchmarks/dashboard_cost.py --devices 20 --selected 10 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a live process (None when it is gone)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuWatch(threading.Thread):
    """Samples the CPU seconds of a few processes; keeps the last value each had while alive."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.stop = threading.Event()

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for name, pid in list(self.pids.items()):
                value = cpu_s(pid)
                if value is not None:
                    self.first.setdefault(name, value)
                    self.last[name] = value

    def used(self, name: str) -> float | None:
        return self.last[name] - self.first[name] if name in self.last else None


class Viewer(threading.Thread):
    """Holds the dashboard's event stream open; notes when each round first appears in a pushed snapshot."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.seen_at, self.pushes, self.stop = url, {}, 0, threading.Event()

    def run(self) -> None:
        with urllib.request.urlopen(self.url + "events", timeout=600) as stream:
            for raw in stream:
                if self.stop.is_set():
                    return
                if raw.startswith(b"data: "):
                    self.pushes += 1
                    now = time.time()
                    for r in json.loads(raw[6:])["rounds"]:
                        self.seen_at.setdefault(r["round"], (now, r["time"]))


def run_once(args: argparse.Namespace, out: Path, dashboard: bool) -> dict[str, Any]:
    from cli.dashboard import start_dashboard
    from emulator.launcher import LaunchOptions, run_fleet
    from emulator.options import load_emulate_config
    from mqtt_broker import Credentials, recorded_process

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    profiles = out.parent / "bench-profiles.toml"
    profiles.write_text("[profile.host]\n[mix]\nhost = 1\n")  # always on, unshaped, the host's own speed
    cfg = load_emulate_config(None, {
        "run": {"strategy": "fedavg", "rounds": args.rounds, "seed": 0},
        "data": {"dataset": "fmnist", "partition": "iid", "clients": args.devices,
                 "samples": args.devices * args.samples_per_device},
        "train": {"lr": 0.01},
        "federation": {"quorum": args.selected, "over_selection": 1.0, "min_devices": args.devices,
                       "deadline_s": 600.0, "grace_s": 0.0, "stale_after_s": 300.0},
        "edge": {"heartbeat_s": args.heartbeat, "ack_timeout_s": 120.0, "publish_timeout_s": 300.0},
        "emulator": {"profiles": str(profiles), "workers": args.workers, "federation": "cost", "timeout_s": 1800.0},
    })
    cpu = CpuWatch()
    cpu.start()
    state: dict[str, Any] = {}

    def on_event(kind: str, info: dict[str, Any]) -> None:
        if kind == "setup":
            rec = recorded_process(out / "broker")
            if rec is not None:
                cpu.watch("broker", rec.pid)
            if dashboard:
                creds = Credentials.load(out / "broker/credentials/observer.toml")
                state["server"] = server = start_dashboard(creds, out / "metrics.jsonl", "127.0.0.1", 0)
                state["viewer"] = viewer = Viewer(server.url)
                viewer.start()
        elif kind == "started" and info["coordinator"]:
            cpu.watch("coordinator", info["coordinator"])
            cpu.watch("launcher", os.getpid())
        elif kind == "round" and "reported" in info:
            print(f"  round {info['round']}: {info['reported']}/{info['selected']} in {info['wall_s']:.1f}s",
                  file=sys.stderr, flush=True)

    try:
        result = run_fleet(LaunchOptions(cfg, out), on_event)
    finally:
        cpu.stop.set()
        if "server" in state:
            state["viewer"].stop.set()
            state["server"].close()
            state["server"].watch.stop()
    delays = [seen - closed for seen, closed in state["viewer"].seen_at.values()] if dashboard else []
    row = {"dashboard": dashboard, "finished": result.finished, "rounds": len(result.rows),
           "round_s": [r["wall_s"] for r in result.rows], "mean_round_s": statistics.mean(r["wall_s"] for r in result.rows),
           "cpu_coordinator_s": cpu.used("coordinator"), "cpu_broker_s": cpu.used("broker"),
           "cpu_launcher_s": cpu.used("launcher"), "delay_s": delays,
           "pushes": state["viewer"].pushes if dashboard else 0}
    for heavy in ("devices", "coordinator"):
        shutil.rmtree(out / heavy, ignore_errors=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=200)
    p.add_argument("--selected", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples-per-device", type=int, default=30)
    p.add_argument("--heartbeat", type=float, default=5.0, help="devices' status interval (s)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: one per core)")
    p.add_argument("--out", default="runs/bench-dashboard")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    out = Path(args.out)
    rows = []
    for dashboard in (False, True):
        print(f"{args.devices} devices, {'with' if dashboard else 'without'} the dashboard open:", file=sys.stderr)
        rows.append(run_once(args, out / ("with" if dashboard else "without"), dashboard))
    (out / "dashboard_cost.json").write_text(json.dumps(rows, indent=2) + "\n")
    off, on = rows
    print(f"\n{args.devices} emulated devices ({args.selected} selected per round, heartbeat {args.heartbeat:g} s), "
          f"FedAvg on Fashion-MNIST iid, {args.rounds} rounds, one run each; {os.cpu_count()} cores\n")
    print("| | without dashboard | with dashboard open | ratio |")
    print("|---|---|---|---|")

    def line(name: str, a: float | None, b: float | None, unit: str) -> None:
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        fa = "-" if a is None else f"{a:.2f} {unit}"
        fb = "-" if b is None else f"{b:.2f} {unit}"
        print(f"| {name} | {fa} | {fb} | {ratio} |")

    line("mean round wall time", off["mean_round_s"], on["mean_round_s"], "s")
    line("coordinator CPU", off["cpu_coordinator_s"], on["cpu_coordinator_s"], "s")
    line("broker CPU", off["cpu_broker_s"], on["cpu_broker_s"], "s")
    line("launcher CPU (hosts the dashboard)", off["cpu_launcher_s"], on["cpu_launcher_s"], "s")
    d = on["delay_s"]
    if d:
        print(f"\npage update delay (round closed -> first pushed snapshot holding it), {len(d)} rounds: "
              f"mean {statistics.mean(d):.2f} s, max {max(d):.2f} s; {on['pushes']} snapshots pushed")
    print(f"every round completed: without {off['finished']}, with {on['finished']}")
    print(f"\nraw results: {out / 'dashboard_cost.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
