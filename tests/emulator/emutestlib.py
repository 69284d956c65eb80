"""Helpers for the emulator tests: a broker with users, a recording connection, waiting, and running
``flayer emulate`` as a child process (stopped by PID)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqtt_broker import (
    BrokerConfig,
    Credentials,
    ManagedBroker,
    add_device,
    load_credentials,
    mosquitto_available,
    start_broker,
)
from transport.credentials import mqtt_connect_settings
from transport.link import Connected, MqttLink, Received, probe

ROOT = Path(__file__).resolve().parents[2]
KIND = "mosquitto" if mosquitto_available() else "embedded"


@dataclass
class TestBroker:
    broker: ManagedBroker
    state: Path
    users: dict[str, Credentials]
    coordinator: Credentials


def start_test_broker(tmp: Path, users: list[str], federation: str = "etest") -> TestBroker:
    state = tmp / "broker"
    broker = start_broker(BrokerConfig(federation=federation, persistence=False), state, kind=KIND,
                          timeout=30)
    try:
        creds = {u: add_device(state, u) for u in users}
        broker.reload()
        tb = TestBroker(broker, state, creds, load_credentials(state, "coordinator"))
        if users:
            wait_until(lambda: _accepts(creds[users[-1]]), 10, "the broker to accept the new users")
        return tb
    except BaseException:
        broker.stop()
        raise


def _accepts(creds: Credentials) -> bool:
    ev = probe(mqtt_connect_settings(creds))
    return ev is not None and ev.ok


def wait_until(pred: Callable[[], bool], timeout: float, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    if not pred():
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Recorder:
    """A connection whose messages land in a list (with their arrival time)."""

    def __init__(self, creds: Credentials, filters: list[str]) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.messages: list[tuple[float, Received]] = []
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=True)
        self.link.start()
        ev = self.events.get(timeout=10)
        assert isinstance(ev, Connected) and ev.ok, ev
        self.link.subscribe(filters)
        time.sleep(0.3)  # SUBACK

    def pump(self) -> list[tuple[float, Received]]:
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return self.messages
            if isinstance(ev, Received):
                self.messages.append((time.monotonic(), ev))

    def wait(self, pred: Callable[[Received], bool], timeout: float = 10.0) -> tuple[float, Received]:
        found: list[tuple[float, Received]] = []

        def check() -> bool:
            found[:] = [m for m in self.pump() if pred(m[1])]
            return bool(found)

        wait_until(check, timeout, "a message")
        return found[0]

    def close(self) -> None:
        self.link.stop(timeout=1.0)


def emulate(args: list[str], log: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m cli.main emulate ARGS`` in its own session, output to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "cli.main", "emulate", *args], cwd=ROOT, env=env,
                                stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """Wait for ``proc``; on timeout SIGTERM (its launcher then stops what it started), then SIGKILL."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        raise AssertionError(f"flayer emulate did not finish within {timeout:.0f}s") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events_of(out: Path) -> list[dict[str, Any]]:
    evs: list[dict[str, Any]] = []
    for f in sorted((out / "events").glob("*.jsonl")):
        evs += read_jsonl(f)
    return sorted(evs, key=lambda e: e["t"])
