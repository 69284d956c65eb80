"""Helpers of the fault suite: a Mosquitto with persistence that a test kills (SIGKILL, by the PID it
started) and restarts on the same port and state folder; the coordinator and edge devices as real
``flayer`` processes with their logs; and the journal accounting that says whether every update a
device saw acknowledged is in the aggregate."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fedtestlib import ROOT, FedBroker, device_toml, federation_toml, start_fed_broker

from coordinator.journal import journal_path, read_journal
from flayer.config import TrainConfig
from flayer.partition import make_partition, save_partition
from flayer.simulation import simulate
from flayer.engine import initial_global_state
from flayer.state import load_tensors
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy
from flayer.train import client_data
from mqtt_broker import BrokerConfig, start_broker
from protocol import decode_update

FEDERATION = "ftest"
PROC_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
ACK_LINE = re.compile(r"^round (\d+): (accepted|duplicate|rejected|late|not_selected)\b", re.MULTILINE)


def wait_until(
    pred: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str] = lambda: ""
) -> Any:
    """Poll ``pred`` every 20 ms; its first truthy value, or AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs()[-4000:]}")
        time.sleep(0.02)


# ---- broker ---------------------------------------------------------------------------------------


def start_persistent_broker(tmp: Path, devices: list[str], **cfg: Any) -> FedBroker:
    """Mosquitto with persistence on, the devices' credentials written and loaded."""
    return start_fed_broker(tmp, "mosquitto", devices, FEDERATION, persistence=True, **cfg)


def kill9_broker(fb: FedBroker) -> int:
    """SIGKILL the Mosquitto this test started (by its PID), and reap it; returns the PID."""
    pid = fb.broker.pid
    os.kill(pid, signal.SIGKILL)
    fb.broker.stop()  # the process is gone: this only reaps it and removes its run record
    return pid


def restart_broker(fb: FedBroker, **cfg: Any) -> None:
    """Start Mosquitto again over the same state folder (same port, same persistence file)."""
    port = fb.broker.port
    fb.broker = start_broker(
        BrokerConfig(federation=FEDERATION, persistence=True, **cfg),
        fb.state_dir,
        kind="mosquitto",
        timeout=30,
    )
    assert fb.broker.port == port


# ---- processes ------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def acks(self) -> list[tuple[int, str]]:
        """(round, status) of every ack this device printed."""
        return [(int(r), s) for r, s in ACK_LINE.findall(self.text())]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def term(self, timeout: float = 120.0) -> int:
        """SIGTERM (a resumed process if it was paused), then its exit status."""
        os.kill(self.popen.pid, signal.SIGTERM)
        os.kill(self.popen.pid, signal.SIGCONT)
        return self.popen.wait(timeout)

    def pause(self) -> None:
        os.kill(self.popen.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.popen.pid, signal.SIGCONT)


def launch(tmp: Path, name: str, *argv: str) -> Proc:
    log = tmp / f"{name}.log"
    fh = open(log, "wb")
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "cli.main", *argv],
            cwd=ROOT,
            env=PROC_ENV,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    finally:
        fh.close()
    return Proc(name, popen, log)


@dataclass
class ProcFederation:
    """A coordinator and devices as ``flayer coordinator`` / ``flayer edge`` processes on digits."""

    tmp: Path
    fb: FedBroker
    fed_toml: Path
    dev_tomls: dict[str, Path]
    coord_state: Path
    rounds: int
    seed: int
    lr: float
    strategy: str
    verbose: str = "-v"  # the flayer processes' log level flag (-vv: debug)
    procs: dict[str, Proc] = field(default_factory=dict)  # each device's latest process
    coordinators: list[Proc] = field(default_factory=list)
    earlier: list[Proc] = field(default_factory=list)  # devices' processes before a restart

    @property
    def coordinator(self) -> Proc:
        return self.coordinators[-1]

    @property
    def devices(self) -> dict[str, Proc]:
        return {k: v for k, v in self.procs.items() if k in self.dev_tomls}

    def start_coordinator(self, *extra: str) -> Proc:
        p = launch(
            self.tmp,
            f"coordinator-{len(self.coordinators) + 1}",
            self.verbose,
            "coordinator",
            "--config",
            str(self.fed_toml),
            *extra,
        )
        self.coordinators.append(p)
        return p

    def start_device(self, name: str) -> Proc:
        if name in self.procs:
            self.earlier.append(self.procs[name])
        runs = 1 + sum(p.name.startswith(f"{name}.") for p in self.earlier)
        p = launch(self.tmp, f"{name}.{runs}", self.verbose, "edge", "--config", str(self.dev_tomls[name]))
        self.procs[name] = p
        return p

    def device_acks(self, name: str) -> list[tuple[int, str]]:
        """Every ack device ``name`` printed, over all its processes."""
        return [
            a for p in [*self.earlier, self.procs[name]] if p.name.startswith(f"{name}.") for a in p.acks()
        ]

    def logs(self) -> str:
        parts = [
            f"==== {p.name}\n{p.text()[-2500:]}"
            for p in [*self.coordinators, *self.earlier, *self.procs.values()]
        ]
        return "\n".join(parts)

    def wait_all(self, timeout: float, procs: list[Proc] | None = None) -> None:
        """Every process (default: the last coordinator and every device still alive) exits 0."""
        procs = (
            procs
            if procs is not None
            else [self.coordinator, *[p for p in self.devices.values() if p.alive()]]
        )
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{p.name} did not finish within {timeout:.0f} s\n{self.logs()}"
                ) from None
        bad = {p.name: p.popen.returncode for p in procs if p.popen.returncode != 0}
        assert not bad, f"exit codes {bad}\n{self.logs()}"

    def stop(self) -> None:
        for p in [*self.coordinators, *self.procs.values()]:
            if p.alive():
                try:
                    p.resume()
                except ProcessLookupError:
                    pass
                p.popen.kill()
                p.popen.wait(10)
        self.fb.broker.stop()

    # ---- what the coordinator left on disk
    def metrics(self) -> list[dict[str, Any]]:
        import json

        path = self.coord_state / "metrics.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [m for m in lines if m.get("kind") == "round"]  # the run and end lines carry no round

    def closed_rounds(self) -> list[int]:
        return [int(m["round"]) for m in self.metrics()]

    def journaled(self, round_: int) -> list[str]:
        path = journal_path(self.coord_state / "journal", round_)
        return [r.client for r in read_journal(path).updates] if path.exists() else []

    def final_state(self) -> dict[str, torch.Tensor]:
        state, _ = load_tensors(self.coord_state / "global.safetensors")
        return state

    def make_strategy(self, ds: Any) -> Strategy:
        return make_strategy(
            self.strategy, ds.model_spec(), TrainConfig(lr=self.lr, batch_size=10, local_epochs=1), {}
        )


def proc_federation(
    tmp: Path,
    ds: Any,
    devices: list[str],
    *,
    rounds: int,
    strategy: str = "fedavg",
    seed: int = 0,
    lr: float = 0.05,
    fed: dict[str, Any] | None = None,
    edge: dict[str, Any] | None = None,
    broker: dict[str, Any] | None = None,
) -> ProcFederation:
    """Broker (persistent), partition file, configs; nothing started yet. Every journal is kept."""
    fb = start_persistent_broker(tmp, devices, **(broker or {}))
    part = make_partition(
        ds.y,
        ds.num_classes,
        len(devices),
        "iid",
        seed,
        meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()},
    )
    part_file = save_partition(part, tmp / f"digits-{len(devices)}.npz")
    coord_state = tmp / "coord"
    fed_kw = {
        "quorum": len(devices),
        "min_devices": len(devices),
        "over_selection": 1.0,
        "deadline_s": 300.0,
        "grace_s": 0.0,
        "keep_journals": 1000,
        **(fed or {}),
    }
    fed_toml = federation_toml(
        tmp / "federation.toml",
        fb.state_dir / "credentials/coordinator.toml",
        coord_state,
        strategy=strategy,
        rounds=rounds,
        dataset="digits",
        seed=seed,
        lr=lr,
        **fed_kw,
    )
    edge_kw = {
        "heartbeat_s": 1.0,
        "ack_timeout_s": 3.0,
        "backoff_s": 0.5,
        "backoff_max_s": 2.0,
        "retries": 8,
        "download_stall_s": 5.0,
        **(edge or {}),
    }
    tomls = {
        d: device_toml(
            tmp / f"{d}.toml",
            fb.state_dir / f"credentials/{d}.toml",
            dataset="digits",
            partition_file=part_file,
            client=i,
            state_dir=tmp / d,
            **edge_kw,
        )
        for i, d in enumerate(devices)
    }
    return ProcFederation(tmp, fb, fed_toml, tomls, coord_state, rounds, seed, lr, strategy)


# ---- accounting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accounting:
    acked: set[tuple[str, int]]  # (device, round) a device saw acked accepted or duplicate
    journaled: Counter  # (device, round) -> journal records
    folded: dict[int, int]  # round -> updates the coordinator folded (metrics.jsonl "accepted")

    @property
    def aggregated(self) -> int:
        return sum(self.folded.values())


def accounting(fed: ProcFederation) -> Accounting:
    acked = {
        (name, r) for name in fed.devices for r, s in fed.device_acks(name) if s in ("accepted", "duplicate")
    }
    journaled: Counter = Counter()
    for r in range(1, fed.rounds + 1):
        for client in fed.journaled(r):
            journaled[(client, r)] += 1
    folded = {int(m["round"]): int(m["accepted"]) for m in fed.metrics()}
    return Accounting(acked, journaled, folded)


def check_accounting(acc: Accounting, rounds: int) -> None:
    """Nothing acknowledged is lost: every acked update is journaled exactly once, and every round
    folded exactly the updates its journal holds."""
    missing = sorted(acc.acked - set(acc.journaled))
    assert not missing, f"acknowledged but not journaled: {missing}"
    twice = sorted(k for k, n in acc.journaled.items() if n > 1)
    assert not twice, f"journaled more than once: {twice}"
    assert sorted(acc.folded) == list(range(1, rounds + 1)), f"closed rounds {sorted(acc.folded)}"
    per_round = Counter(r for _, r in acc.journaled.elements())
    assert {r: per_round.get(r, 0) for r in acc.folded} == acc.folded, (dict(per_round), acc.folded)


def fold_journals(fed: ProcFederation, strategy: Strategy) -> dict[str, torch.Tensor]:
    """The final model recomputed from the initial model and the journaled updates alone."""
    g = initial_global_state(strategy, fed.seed)
    for r in range(1, fed.rounds + 1):
        agg = strategy.aggregator(g)
        for rec in read_journal(journal_path(fed.coord_state / "journal", r)).updates:
            agg.fold(decode_update(rec.data).update)
        g = agg.result()
    return g


def reference_run(fed: ProcFederation, ds: Any, strategy: Strategy, devices: int) -> dict[str, torch.Tensor]:
    """An uninterrupted run with the same seeds and partition, every device every round (in-process)."""
    part = make_partition(
        ds.y,
        ds.num_classes,
        devices,
        "iid",
        fed.seed,
        meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()},
    )
    clients = [client_data(ds, c) for c in part.clients]
    return dict(simulate(strategy, clients, fed.rounds, fed.seed).global_state)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)
