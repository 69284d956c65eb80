"""A live coordinator (the real server loop, in this process) on a real Mosquitto, the devices that
send it bad input with their real credentials, and the bookkeeping that checks each bad input
moved exactly the counter it must."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from craft import Device, sign
from faultlib import FEDERATION, wait_until
from fedtestlib import FedBroker, federation_toml

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from protocol import Topics, blob_digest, decode_update

T = Topics(FEDERATION)
SELECTED = ["dev-a", "dev-b", "dev-c"]  # selected every round; dev-x is authorised but never online


def live_coordinator(tmp: Path, fb: FedBroker, rounds: int, **fed: Any) -> Coordinator:
    """The coordinator of a digits federation whose rounds select dev-a, dev-b and dev-c."""
    kw: dict[str, Any] = {"quorum": 3, "min_devices": 3, "over_selection": 1.0, "deadline_s": 120.0, **fed}
    path = federation_toml(
        tmp / "federation.toml",
        fb.state_dir / "credentials/coordinator.toml",
        tmp / "coord",
        strategy="fedavg",
        rounds=rounds,
        dataset="digits",
        **kw,
    )
    return Coordinator(load_coordinator_config(path), fb.coordinator)


def total(coord: Coordinator) -> int:
    return sum(dict(coord.counters).values())


class Campaign:
    """Sends bad inputs one case at a time and checks the counters each one moved."""

    def __init__(self, coord: Coordinator, thread: Any, ledger: Any) -> None:
        self.coord, self.thread, self.ledger = coord, thread, ledger
        self.expected: Counter[str] = Counter()  # this round's counters, as the cases predict them
        self.flexible = 0  # random mutations: each counted bad_chunk at once or incomplete at the close
        self.tried = 0
        self.rows: list[tuple[str, int]] = []  # for the ledger, once the test's checks passed

    def case(self, what: str, send: Callable[[], object], now: dict[str, int], later: int = 0) -> None:
        """``send`` publishes the case's payloads; ``now``: the counters that must move at once;
        ``later``: unfinished blobs it leaves, counted ``incomplete`` when the round closes."""
        before = Counter(dict(self.coord.counters))
        send()
        want = sum(now.values())
        wait_until(lambda: total(self.coord) - sum(before.values()) >= want, 30, f"the counters of {what}")
        time.sleep(0.05)  # anything extra would show up now
        moved = Counter(dict(self.coord.counters)) - before
        assert moved == Counter(now), f"{what}: counters moved {dict(moved)}, expected {now}"
        self._done(what, want + later, Counter(now) + Counter({"incomplete": later}))

    def mutations(self, what: str, send: Callable[[], object], n: int) -> None:
        """Payloads each counted ``bad_chunk`` at once or ``incomplete`` at the close (not known which)."""
        send()
        self.flexible += n
        self._done(what, n, Counter())

    def sync(self, dev: Device) -> None:
        """Wait until the coordinator has handled everything ``dev`` sent: a garbage metrics message
        sent after it (handled in order) is counted."""
        before = Counter(dict(self.coord.counters))
        dev.publish([(T.metrics(dev.id), b"sync")])
        wait_until(lambda: self.coord.counters["bad_message"] > before["bad_message"], 30, "the sync marker")
        moved = Counter(dict(self.coord.counters)) - before
        assert set(moved) <= {"bad_message", "bad_chunk"} and moved["bad_message"] == 1, (
            moved
        )  # + late mutations
        self._done("garbage metrics message", 1, Counter({"bad_message": 1}))

    def _done(self, what: str, n: int, counters: Counter[str]) -> None:
        assert self.thread.is_alive(), f"the coordinator died on {what}"
        self.expected += counters
        self.tried += n
        self.rows.append((what, n))

    def record(self) -> None:
        """Every case rejected: each one counted and logged (checked by the test before it calls this)."""
        for what, n in self.rows:
            self.ledger.bad_input(what, n, n)

    def check_round(self, rejected: dict[str, int]) -> Counter[str]:
        """The round's metrics line holds exactly the predicted counters; returns them."""
        got, want = Counter(rejected), self.expected
        # a mutation that changes the sender's id cannot be signed by the device: counted unsigned
        flex = got["bad_chunk"] + got["incomplete"] + got["unsigned"] - want["bad_chunk"] - want["incomplete"]
        assert flex == self.flexible, f"random mutations: {flex} counted, {self.flexible} sent ({dict(got)})"
        assert got["bad_chunk"] >= want["bad_chunk"] and got["incomplete"] >= want["incomplete"]
        fixed = {k: v for k, v in got.items() if k not in ("bad_chunk", "incomplete", "unsigned")}
        assert fixed == {k: v for k, v in want.items() if k not in ("bad_chunk", "incomplete") and v}, (
            got,
            want,
        )
        self.expected, self.flexible = Counter(), 0
        return got


def mutate(rng: np.random.Generator, payload: bytes) -> bytes:
    """One to three random bit flips, a truncation, an extension or a boundary value in a length field."""
    b = bytearray(payload)
    op = int(rng.integers(0, 4))
    if op == 0:
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, 110 if rng.random() < 0.7 else len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif op == 1:
        del b[int(rng.integers(0, len(b))) :]
    elif op == 2:
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    else:
        at = int(rng.choice([8, 12, 16, 20, 28, 68, 69]))
        b[at : at + 4] = int(rng.choice([0, 1, 2**31, 2**32 - 1, len(b)])).to_bytes(4, "little")
    return sign(bytes(b))  # the device signs what it sends, junk included


def digest(blob: bytes) -> str:
    return blob_digest(blob)


def fold(coord: Coordinator, g: dict[str, torch.Tensor], blobs: list[bytes]) -> dict[str, torch.Tensor]:
    """The model the honest ``blobs`` alone give (folded in this order)."""
    agg = coord.strategy.aggregator(g)
    for blob in blobs:
        agg.fold(decode_update(blob).update)
    return agg.result()
