"""Helpers for the federation tests: a broker with devices, config files, and a recording MQTT link."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqtt_broker import BrokerConfig, Credentials, ManagedBroker, add_device, load_credentials, start_broker
from transport.credentials import mqtt_connect_settings
from transport.link import Connected, MqttLink, Received, probe

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FedBroker:
    broker: ManagedBroker
    state_dir: Path
    devices: dict[str, Credentials]
    coordinator: Credentials

    @property
    def kind(self) -> str:
        return self.broker.kind


def start_fed_broker(tmp: Path, kind: str, devices: list[str], federation: str = "itest", persistence: bool = False,
                     **cfg: Any) -> FedBroker:
    """A broker of ``kind`` with the devices' credentials written, loaded and accepted."""
    state = tmp / "broker"
    broker = start_broker(BrokerConfig(federation=federation, persistence=persistence, **cfg), state, kind=kind,
                          timeout=30)
    try:
        creds = {d: add_device(state, d) for d in devices}
        broker.reload()
        fb = FedBroker(broker, state, creds, load_credentials(state, "coordinator"))
        wait_connectable(creds[devices[-1]])
        return fb
    except BaseException:
        broker.stop()
        raise

def iid_shards(ds: Any, clients: int, seed: int = 0) -> list:
    """``ds`` split iid across ``clients``: each client's ClientData."""
    from flayer.partition import make_partition
    from flayer.train import client_data

    part = make_partition(ds.y, ds.num_classes, clients, "iid", seed)
    return [client_data(ds, c) for c in part.clients]


class Recorder:
    """An MqttLink whose events land in a list the test can wait on."""

    def __init__(self, creds: Credentials, subscribe: list[str] | None = None, clean_session: bool = True) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.messages: list[Received] = []
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=clean_session)
        self.link.start()
        ev = self.next(lambda e: isinstance(e, Connected), 10.0)
        assert ev is not None and ev.ok, f"{creds.username} could not connect: {ev}"
        if subscribe:
            self.link.subscribe(subscribe)
            time.sleep(0.2)  # SUBACK

    def next(self, pred: Callable[[Any], bool], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(ev, Received):
                self.messages.append(ev)
            if pred(ev):
                return ev
        return None

    def wait_message(self, pred: Callable[[Received], bool], timeout: float = 10.0) -> Received | None:
        for m in self.messages:
            if pred(m):
                return m
        return self.next(lambda e: isinstance(e, Received) and pred(e), timeout)

    def drain(self, seconds: float) -> list[Received]:
        self.next(lambda e: False, seconds)
        return self.messages

    def close(self) -> None:
        self.link.stop()


def wait_connectable(creds: Credentials, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ev = probe(mqtt_connect_settings(creds))
        if ev is not None and ev.ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{creds.username} still refused after the reload: {ev}")
        time.sleep(0.1)


def federation_toml(path: Path, creds: Path, state_dir: Path, *, strategy: str, rounds: int, dataset: str,
                    seed: int = 0, lr: float = 0.05, **federation: Any) -> Path:
    fed = {"quorum": 1, "min_devices": 1, "over_selection": 1.0, "deadline_s": 60.0, "grace_s": 0.0, **federation}
    lines = ["[federation]", f'credentials = "{creds}"', f'state_dir = "{state_dir}"']
    lines += [f"{k} = {_toml(v)}" for k, v in fed.items()]
    lines += ["[run]", f'strategy = "{strategy}"', f"rounds = {rounds}", f"seed = {seed}",
              "[data]", f'dataset = "{dataset}"', "[train]", f"lr = {lr}", "batch_size = 10", "local_epochs = 1"]
    path.write_text("\n".join(lines) + "\n")
    return path


def device_toml(path: Path, creds: Path, *, dataset: str, partition_file: Path, client: int, state_dir: Path,
                **edge: Any) -> Path:
    edge = {"device": "cpu", "heartbeat_s": 2.0, "ack_timeout_s": 10.0, "threads": 1, **edge}
    lines = [f'credentials = "{creds}"', "[data]", f'dataset = "{dataset}"', f'partition_file = "{partition_file}"',
             f"client = {client}", "[edge]", f'state_dir = "{state_dir}"']
    lines += [f"{k} = {_toml(v)}" for k, v in edge.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def strategy_under_test() -> str:
    """FLAYER when this build has it, else FedAvg (the MQTT path does not depend on the method)."""
    from flayer.strategies import STRATEGIES

    return "flayer" if "flayer" in STRATEGIES else "fedavg"


def finished(coord: Any, thread: Any, timeout: float, rounds: int | None = None) -> Any:
    """Wait for a coordinator started with ``coord.start()``; its result, asserted finished (after
    ``rounds`` rounds when given)."""
    thread.join(timeout)
    assert not thread.is_alive(), "the coordinator did not finish"
    result = coord._thread_result
    assert not isinstance(result, BaseException), result
    assert result is not None and result.finished, result
    if rounds is not None:
        assert result.rounds_done == rounds, result.rounds_done
    return result
