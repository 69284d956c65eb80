"""Broker load with and without models over HTTP, side by side: the same emulated fleet run twice by
``flayer emulate``, once over the broker only and once with ``--http-models`` (nginx serves the model
files, devices fetch them by range requests), measuring the Mosquitto process each run started.

Per round (from the coordinator's round records: each round's close time and its wall seconds) it reads,
from ``/proc/<pid>`` of the broker, sampled every 0.25 s: CPU seconds (utime + stime of ``stat``) and
the bytes the process wrote and read (``wchar`` / ``rchar`` of ``io``: every socket send and receive,
plus its log file, which is small). With ``--http-models`` it also reads nginx's CPU (master and worker)
and the bytes its access log says it sent (``$bytes_sent``). Updates still travel through the broker
(device -> broker -> coordinator) in both runs; what moves off it is the model fan-out.

    python benchmarks/http_models.py --devices 200,1000 --selected 100 --rounds 3 --out docs/results/http-models

Each run's output folder is kept under ``--out`` (``<devices>-<mode>``) with a ``measure.json``; a run
whose ``measure.json`` is there is not run again (delete it to re-measure), so an interrupted
benchmark resumes. Run it under ``nice`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15 of stat)


def _io(pid: int) -> dict[str, int] | None:
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Sampler:
    """(t, broker cpu s, broker wchar, broker rchar, nginx cpu s) every ``period`` seconds."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.broker: int | None = None
        self.nginx: int | None = None
        self.samples: list[tuple[float, float, int, int, float]] = []
        self.stop = threading.Event()
        self._nginx_cpu: dict[int, float] = {}  # the last reading per nginx process (workers included)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            if self.broker is None:
                continue
            cpu, io = _cpu_s(self.broker), _io(self.broker)
            if cpu is None or io is None:
                continue
            if self.nginx is not None:
                for pid in [self.nginx, *_children(self.nginx)]:
                    c = _cpu_s(pid)
                    if c is not None:
                        self._nginx_cpu[pid] = c
            self.samples.append((time.time(), cpu, io["wchar"], io["rchar"], sum(self._nginx_cpu.values())))

    def at(self, t: float) -> tuple[float, float, int, int, float]:
        """The last sample at or before ``t`` (the first one when none is)."""
        before = [s for s in self.samples if s[0] <= t]
        return before[-1] if before else self.samples[0]


def _nginx_bytes(out: Path, t0: float, t1: float) -> int:
    """Bytes nginx sent (access log $bytes_sent) for requests logged in [t0, t1]."""
    log = out / "nginx/access.log"
    if not log.exists():
        return 0
    total = 0
    for line in log.read_text().splitlines():
        m = re.search(r"\[([^\]]+)\] \"[^\"]*\" \d{3} (\d+) ", line)
        if m:
            t = _log_time(m.group(1))
            if t0 - 1 <= t <= t1 + 1:
                total += int(m.group(2))
    return total


def _log_time(text: str) -> float:
    from datetime import datetime

    return datetime.strptime(text, "%d/%b/%Y:%H:%M:%S %z").timestamp()


def run_emulate(cmd: list[str], out: Path, watch: Callable[[str], None], stop: threading.Event) -> str:
    """Run ``cmd`` (a ``flayer emulate``) from the repository root, hand each output line to ``watch`` as it
    comes, then set ``stop`` (the sampler's) and keep the output beside ``out`` as ``<out>.log``; its text,
    or SystemExit naming the log when the run failed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        watch(line)
    rc = proc.wait()
    stop.set()
    log = out.parent / f"{out.name}.log"
    log.write_text("".join(lines))
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return "".join(lines)


def run_one(args: argparse.Namespace, devices: int, http: bool, out: Path) -> dict[str, Any]:
    done = out / "measure.json"
    if done.exists():
        return json.loads(done.read_text())
    quorum = max(1, math.floor(args.selected / args.over_selection))
    cmd = [sys.executable, "-m", "cli.main", "emulate", "--dataset", args.dataset, "--clients", str(devices),
           "--rounds", str(args.rounds), "--strategy", args.strategy, "--seed", "0", "--partition", "iid",
           "--quorum", str(quorum),
           "--over-selection", str(args.over_selection), "--min-devices", str(min(devices, args.selected)),
           "--deadline", str(args.deadline), "--mix", args.mix, "--broker-kind", "mosquitto", "--out", str(out),
           "--heartbeat", str(args.heartbeat), "--timeout", str(args.timeout)]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if http:
        cmd.append("--http-models")
    sampler = Sampler()
    t0 = time.time()

    def watch(line: str) -> None:
        if m := re.search(r"mosquitto broker pid (\d+)", line):
            sampler.broker = int(m.group(1))
        if m := re.search(r"nginx pid (\d+)", line):
            sampler.nginx = int(m.group(1))

    run_emulate(cmd, out, watch, sampler.stop)
    if not sampler.samples:
        raise SystemExit(f"no broker samples for {' '.join(cmd)}; see {out.parent / (out.name + '.log')}")
    closes = {r["round"]: r["time"] for r in map(json.loads, (out / "coordinator/metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "round"}
    walls = {r["round"]: r["wall_s"] for r in map(json.loads, (out / "rounds.jsonl").read_text().splitlines())}
    rounds = []
    for r in sorted(closes):
        end, start = closes[r], closes[r] - walls[r]
        a, b = sampler.at(start), sampler.at(end)
        rounds.append({"round": r, "wall_s": round(walls[r], 2), "broker_cpu_s": round(b[1] - a[1], 2),
                       "broker_wrote_mb": round((b[2] - a[2]) / 1e6, 2), "broker_read_mb": round((b[3] - a[3]) / 1e6, 2),
                       "nginx_cpu_s": round(b[4] - a[4], 2),
                       "nginx_sent_mb": round(_nginx_bytes(out, start, end) / 1e6, 2)})
    first, last = sampler.samples[0], sampler.samples[-1]
    result = {"devices": devices, "http_models": http, "selected": args.selected, "rounds": rounds,
              "run_s": round(time.time() - t0, 1), "broker_cpu_s_total": round(last[1] - first[1], 2),
              "broker_wrote_mb_total": round((last[2] - first[2]) / 1e6, 2), "command": " ".join(cmd[1:])}
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="200,1000", help="fleet sizes, comma separated (200,1000)")
    p.add_argument("--selected", type=int, default=100, help="devices selected per round (100)")
    p.add_argument("--over-selection", type=float, default=1.3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--samples", type=int, default=20000, help="samples of the data set shared by the fleet (20000)")
    p.add_argument("--strategy", default="fedavg")
    p.add_argument("--mix", default="laptop=1", help="device profiles (laptop=1: no emulated link delays)")
    p.add_argument("--deadline", type=float, default=300.0)
    p.add_argument("--heartbeat", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--out", default="runs/bench-http-models")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in (int(x) for x in args.devices.split(",")):
        for http in (False, True):
            folder = out / f"{n}-{'http' if http else 'broker'}"
            results.append({**run_one(args, n, http, folder), "out": str(folder)})
    print(f"per round, mean over {args.rounds} rounds, {args.selected} selected of each fleet "
          f"(broker: Mosquitto's /proc/<pid> stat and io)")
    print(f"{'devices':>7} {'models':>10} {'broker CPU s':>12} {'broker wrote MB':>15} {'broker read MB':>14} "
          f"{'nginx CPU s':>11} {'nginx sent MB':>13} {'round s':>8}")
    for r in results:
        rows = r["rounds"]
        print(f"{r['devices']:>7} {'HTTP' if r['http_models'] else 'broker':>10} {_mean(rows, 'broker_cpu_s'):>12.2f} "
              f"{_mean(rows, 'broker_wrote_mb'):>15.1f} {_mean(rows, 'broker_read_mb'):>14.1f} "
              f"{_mean(rows, 'nginx_cpu_s'):>11.2f} {_mean(rows, 'nginx_sent_mb'):>13.1f} {_mean(rows, 'wall_s'):>8.1f}")
    by_n: dict[int, dict[bool, dict[str, Any]]] = {}
    for r in results:
        by_n.setdefault(r["devices"], {})[r["http_models"]] = r
    print("whole run (the final plan's downloads by every device included):")
    for r in results:
        log = Path(r["out"]) / "nginx/access.log" if "out" in r else None
        sent = [int(m.group(1)) for line in (log.read_text().splitlines() if log and log.exists() else [])
                if (m := re.search(r"\" \d{3} (\d+) ", line))]
        print(f"{r['devices']:>7} {'HTTP' if r['http_models'] else 'broker':>10}: broker CPU {r['broker_cpu_s_total']:.1f} s, "
              f"broker wrote {r['broker_wrote_mb_total']:.0f} MB, nginx {len(sent)} responses {sum(sent) / 1e6:.0f} MB, "
              f"run {r['run_s']:.0f} s")
    for n, pair in by_n.items():
        if True in pair and False in pair:
            ratio = {k: _mean(pair[True]["rounds"], k) / max(_mean(pair[False]["rounds"], k), 1e-9)
                     for k in ("broker_cpu_s", "broker_wrote_mb", "broker_read_mb", "wall_s")}
            print(f"{n:>7} HTTP/broker: broker CPU x{ratio['broker_cpu_s']:.3f}, broker wrote "
                  f"x{ratio['broker_wrote_mb']:.3f}, broker read x{ratio['broker_read_mb']:.3f}, "
                  f"round time x{ratio['wall_s']:.3f}")
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
