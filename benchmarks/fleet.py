"""Emulated fleets at scale on this machine: how many devices, how many of them training per round.

Runs ``flayer emulate`` (FedAvg, FedAvgCNN on Fashion-MNIST, an iid partition of ``--samples-per-device``
samples per device, every device always on and unshaped, so the host's speed is all that limits it;
a 120 s MQTT keep-alive, so a busy shared machine does not drop connections while thousands connect)
for each ``DEVICES:SELECTED`` of ``--configs``, and prints per fleet: round wall time, devices that
reported per round, peak memory per worker process and per device (above the worker's memory before
its devices started, up to the end of the last round; "end" includes every device saving its personal
model after the federation), the broker's established connections (counted from /proc/net/tcp on the broker
port, sampled every half second), setup time, and whether every round completed.

Then, unless ``--skip-limit``, the connection limit of one process: N bare device connections with
paho's own thread each (``loop_start``) vs one shared network thread (:class:`emulator.netloop.
SharedNetwork`), counted 20 s after they start.

``--model-slots N``: devices per worker holding a model at once (the emulator's default without it).
Each fleet's row is written to ``OUT/fleet.json`` as soon as it is measured, and ``--resume`` skips the
fleets already there (the big ones take long on 2 cores). Without ``--keep``, a device's saved models
(``personal.safetensors``, ``global.safetensors``, ``global_model.bin``: about 7 MB) are deleted once it
saved them after the federation, so 10,000 devices do not fill the disk; the devices write them all the same.

    python benchmarks/fleet.py                                  # 100:100, 200:100, 1000:100
    python benchmarks/fleet.py --configs 100:100 --rounds 2     # one fleet
    python benchmarks/fleet.py --configs 5000:100,10000:100 --skip-limit --resume
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def established(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the broker's side of each client)."""
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 3 and parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


class ConnectionSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.port: int | None = None
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            if self.port is not None:
                self.peak = max(self.peak, established(self.port))


class Reaper(threading.Thread):
    """Deletes the models a device saved after the federation (both files there: it is done with them)."""

    FILES = ("personal.safetensors", "global.safetensors", "global_model.bin")

    def __init__(self, devices: Path) -> None:
        super().__init__(daemon=True)
        self.devices, self.stop, self.reaped = devices, threading.Event(), 0

    def run(self) -> None:
        while not self.stop.wait(2.0):
            self.sweep()

    def sweep(self) -> None:
        try:
            folders = list(os.scandir(self.devices))
        except OSError:
            return
        for d in folders:
            folder = Path(d.path)
            if (folder / "personal.safetensors").exists() and (folder / "global.safetensors").exists():
                for name in self.FILES:
                    (folder / name).unlink(missing_ok=True)
                self.reaped += 1


def run_fleet_once(devices: int, selected: int, rounds: int, per_device: int, workers: int, network: str,
                   out: Path, model_slots: int | None = None, reap: bool = True) -> dict[str, Any]:
    from emulator.launcher import EmulatorError, LaunchOptions, run_fleet
    from emulator.options import load_emulate_config

    profiles = out.parent / "bench-profiles.toml"
    profiles.write_text("[profile.host]\n[mix]\nhost = 1\n")  # always on, unshaped, the host's own speed
    cfg = load_emulate_config(None, {
        "run": {"strategy": "fedavg", "rounds": rounds, "seed": 0},
        "data": {"dataset": "fmnist", "partition": "iid", "clients": devices,
                 "samples": devices * per_device},
        "train": {"lr": 0.01},
        "federation": {"quorum": selected, "over_selection": 1.0, "min_devices": devices, "deadline_s": 600.0,
                       "grace_s": 0.0, "stale_after_s": 300.0},
        "edge": {"heartbeat_s": 30.0, "ack_timeout_s": 120.0, "publish_timeout_s": 300.0, "keepalive_s": 120},
        "emulator": {"profiles": str(profiles), "workers": workers, "network": network, "federation": "bench",
                     "timeout_s": 5400.0, **({} if model_slots is None else {"model_slots": model_slots})},
    })
    sampler = ConnectionSampler()
    sampler.start()
    reaper = Reaper(out / "devices")
    if reap:
        reaper.start()

    def on_event(kind: str, info: dict[str, Any]) -> None:
        if kind == "setup":
            sampler.port = json.loads((out / "broker/broker.json").read_text())["port"]
            print(f"  {devices} devices: {info['spec'].workers} workers, {info['spec'].network} network",
                  file=sys.stderr, flush=True)
        elif kind == "round" and "reported" in info:
            print(f"  round {info['round']}: {info['reported']}/{info['selected']} in {info['wall_s']:.1f}s",
                  file=sys.stderr, flush=True)
        elif kind == "note":
            print(f"  {info['text']}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        result = run_fleet(LaunchOptions(cfg, out), on_event)
        error = ""
    except EmulatorError as exc:
        result, error = None, str(exc).splitlines()[0]
    sampler.stop.set()
    reaper.stop.set()
    row: dict[str, Any] = {"devices": devices, "selected": selected, "rounds_asked": rounds, "error": error,
                           "wall_s": time.monotonic() - t0, "connections_peak": sampler.peak,
                           "model_slots": cfg.emulator.model_slots}
    if result is None:
        return row
    prog = result.progress
    base = {w: float(e.get("base_rss_mb", 0.0)) for w, e in prog.workers.items()}
    rounds_peak = {w: float(e.get("peak_rss_mb", 0.0)) for w, e in prog.wrap_up.items()}  # VmHWM at wrap-up
    hosted = sum(len(e.get("devices", [])) for e in prog.workers.values())
    row.update({
        "network": result.spec.network, "workers": result.spec.workers, "setup_s": result.setup_s,
        "rounds_done": len(result.rows), "finished": result.finished,
        "reported": [r["reported"] for r in result.rows],
        "round_s": [r["wall_s"] for r in result.rows],
        "worker_peak_rounds_mb": max(rounds_peak.values(), default=0.0),
        "worker_peak_mb": max(prog.peak_rss_mb.values(), default=0.0),
        "per_device_mb": sum(rounds_peak[w] - base.get(w, 0.0) for w in rounds_peak) / max(1, hosted),
        "max_connected": sum(prog.max_connected.values()),
        "coordinator_mb_in": [round(r["coordinator_mb_in"], 1) for r in result.rows],
        "slots_peak": slots_peak(out),
    })
    return row


def slots_peak(out: Path) -> dict[str, int]:
    """The most model slots each worker had held at once (its last ``stats`` event)."""
    peak: dict[str, int] = {}
    for f in sorted((out / "events").glob("worker-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("kind") == "stats" and "slots_peak" in ev:
                peak[str(ev.get("worker"))] = int(ev["slots_peak"])
    return peak


def connection_limit(n: int, mode: str, state: Path) -> tuple[int, float]:
    """(connected after 20 s, seconds to connect them) for ``n`` device links in this process."""
    from emulator.netloop import SharedNetwork
    from mqtt_broker import BrokerConfig, add_device, start_broker
    from transport.credentials import mqtt_connect_settings
    from transport.link import MqttLink

    shutil.rmtree(state, ignore_errors=True)
    broker = start_broker(BrokerConfig(federation="limit", persistence=False), state, timeout=30)
    net = SharedNetwork().start() if mode == "shared" else None
    links: list[MqttLink] = []
    try:
        creds = [add_device(state, f"d{i}") for i in range(n)]
        broker.reload()
        time.sleep(1.0)
        t0 = time.monotonic()
        sink: queue.Queue[Any] = queue.Queue()
        for c in creds:
            links.append(MqttLink(mqtt_connect_settings(c), sink.put, network=net))
            links[-1].start()
        done_at = None
        while time.monotonic() - t0 < 20:
            up = sum(link.connected.is_set() for link in links)
            if up == n and done_at is None:
                done_at = time.monotonic() - t0
                break
            time.sleep(0.2)
        up = sum(link.connected.is_set() for link in links)
        return up, (done_at if done_at is not None else float("nan"))
    finally:
        for link in links:
            link.stop(timeout=0.2)
        if net is not None:
            net.close()
        broker.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="100:100,200:100,1000:100", help="DEVICES:SELECTED,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples-per-device", type=int, default=40)
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: one per core)")
    p.add_argument("--network", default="auto", choices=("auto", "thread", "shared"))
    p.add_argument("--out", default="runs/bench-fleet")
    p.add_argument("--skip-limit", action="store_true", help="skip the per-process connection limit")
    p.add_argument("--model-slots", type=int, help="devices per worker holding a model at once (default: "
                                                     "the emulator's)")
    p.add_argument("--resume", action="store_true", help="keep the fleets already in OUT/fleet.json")
    p.add_argument("--limit-n", type=int, default=600)
    p.add_argument("--keep", action="store_true",
                   help="keep the devices' and the coordinator's state folders (about 4.6 MB per device: "
                        "each saves its personal and the final global model)")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[int, int], dict[str, Any]] = {}
    if args.resume and (out / "fleet.json").exists():
        done = {(r["devices"], r["selected"]): r for r in json.loads((out / "fleet.json").read_text())}
    rows = []
    for item in args.configs.split(","):
        devices, selected = (int(x) for x in item.split(":"))
        if (devices, selected) in done:
            print(f"fleet of {devices}, {selected} selected per round: in {out / 'fleet.json'}", file=sys.stderr)
            rows.append(done[(devices, selected)])
            continue
        print(f"fleet of {devices}, {selected} selected per round:", file=sys.stderr, flush=True)
        rows.append(run_fleet_once(devices, selected, args.rounds, args.samples_per_device, args.workers,
                                   args.network, out / f"fleet-{devices}", args.model_slots, not args.keep))
        if not args.keep:
            for heavy in ("devices", "coordinator"):
                shutil.rmtree(out / f"fleet-{devices}" / heavy, ignore_errors=True)
        (out / "fleet.json").write_text(json.dumps(rows, indent=2) + "\n")  # after each fleet: resumable
    print(f"\nFedAvg, FedAvgCNN (582,026 parameters, 2.3 MB at 28x28) on Fashion-MNIST iid, "
          f"{args.samples_per_device} samples per device, {args.rounds} rounds, every device always on and "
          f"unshaped; {os.cpu_count()} cores\n")
    print("| devices | selected/round | workers x network | setup s | round wall s (each) | reported/round "
          "| peak RSS per worker: rounds (end) | per device | broker connections | rounds completed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("error") and "rounds_done" not in r:
            print(f"| {r['devices']} | {r['selected']} | - | - | - | - | - | - | {r['connections_peak']} | "
                  f"no: {r['error']} |")
            continue
        print(f"| {r['devices']} | {r['selected']} | {r['workers']} x {r['network']} | {r['setup_s']:.0f} | "
              f"{', '.join(f'{s:.1f}' for s in r['round_s'])} | {', '.join(map(str, r['reported']))} | "
              f"{r['worker_peak_rounds_mb']:.0f} MB ({r['worker_peak_mb']:.0f} MB) | "
              f"{r['per_device_mb']:.1f} MB | "
              f"{r['connections_peak']} | "
              f"{'yes' if r['finished'] else 'no'} ({r['rounds_done']}/{r['rounds_asked']}) |")
    if not args.skip_limit:
        print(f"\nOne process, {args.limit_n} device connections (bare links, connected within 20 s):\n")
        print("| network side | connected | seconds to connect all |")
        print("|---|---|---|")
        for mode in ("thread", "shared"):
            up, secs = connection_limit(args.limit_n, mode, out / f"limit-{mode}")
            side = "paho thread per client (loop_start)" if mode == "thread" else "one shared thread (epoll)"
            took = f"{secs:.1f}" if secs == secs else "not all within 20 s"
            print(f"| {side} | {up}/{args.limit_n} | {took} |", flush=True)
    print(f"\nraw results: {out / 'fleet.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
