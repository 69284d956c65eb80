"""One emulated device across its lifetimes, each one a real :class:`edge_client.client.EdgeClient`.

Online, the device *is* an EdgeClient (its own MQTT connection and credentials, its own threads,
its own state folder). Going offline stops it cleanly (a retained ``offline`` status, then
DISCONNECT); a crash drops it (:meth:`EdgeClient.crash`: no status, no DISCONNECT, the broker
publishes the last will); coming back online, or rebooting after a crash, starts a new EdgeClient
over the same state folder, which resumes from what it finds there. What the emulator adds to the
real client, through its hooks only:

- ``shaper``: the profile's link (:class:`emulator.shaping.LinkShaper`), also counting bytes per round;
- ``after_compute``: a device ``slowdown`` times slower than this host takes ``slowdown`` x the thread
  CPU time its computation used here; the client waits for what its wall time has not covered yet
  (contention between emulated devices does not count as device time; factors below 1 cannot make
  anything faster);
- ``sleep``: interruptible, so a device going offline or crashing stops waiting at once;
- ``model_slots``: the worker's :class:`emulator.slots.ModelSlots`, so only so many of its devices hold
  a model at once (an idle device holds none: its models and client state are on disk).

Transitions are queued per device and applied in order on a shared pool (:meth:`EmulatedDevice.post`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from edge_client.client import EdgeClient, ModelSlots
from edge_client.config import EdgeSettings
from flayer.train import ClientData
from transport.credentials import Credentials
from transport.link import NetworkDriver
from transport.wirecount import count_wire_bytes

from .events import EventLog
from .profiles import DeviceProfile
from .shaping import LinkShaper

__all__ = ["STATES", "ByteCounter", "EmulatedDevice"]

log = logging.getLogger(__name__)

STATES = ("offline", "online", "crashed", "finished", "failed")
# an idle emulated client wakes for its timers only (heartbeat, re-sends, stalled downloads), or at
# least this often: thousands of device threads of one worker waking every second compete with its
# network thread for the interpreter (docs/results/fleet.md, 5,000 and 10,000 devices)
IDLE_TICK_S = 15.0


class ByteCounter:
    """Bytes per (round, direction) over all devices of a worker; thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_round: dict[int, dict[str, int]] = {}
        self.changed = False

    def add(self, round_: int, direction: str, nbytes: int) -> None:
        with self._lock:
            slot = self.by_round.setdefault(round_, {"up": 0, "down": 0})
            slot[direction] += nbytes
            self.changed = True

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            self.changed = False
            return {str(r): dict(v) for r, v in self.by_round.items()}


class EmulatedDevice:
    def __init__(self, index: int, device_id: str, profile: DeviceProfile, settings: EdgeSettings,
                 creds: Credentials, data: ClientData, log_: EventLog, counter: ByteCounter, pool: Executor,
                 network: NetworkDriver | None = None,
                 client_factory: Callable[..., EdgeClient] = EdgeClient, model_slots: ModelSlots | None = None) -> None:
        self.index, self.id, self.profile = index, device_id, profile
        self.settings, self.creds, self.data = settings, creds, data
        self.log, self.counter, self.pool, self.network = log_, counter, pool, network
        self.client_factory = client_factory
        self.model_slots = model_slots  # shared by the worker's devices (emulator.slots)
        self.shaper = LinkShaper(profile)  # delays only: the bytes are counted on the socket (see _online)
        self.client: EdgeClient | None = None
        self.state = "offline"
        self.instances = self.crashes = 0
        self.final_acc: float | None = None
        self.rounds_trained: list[int] = []
        self._down = threading.Event()  # the current instance stops waiting (offline, crash)
        self._ops: deque[str] = deque()
        self._busy = False
        self._lock = threading.Lock()

    # ---- transitions (queued, applied in order) -----------------------------------------------------
    def post(self, op: str) -> None:
        """Queue ``online``, ``offline`` or ``crash``."""
        with self._lock:
            self._ops.append(op)
            if self._busy:
                return
            self._busy = True
        self.pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._ops:
                    self._busy = False
                    return
                op = self._ops.popleft()
            try:
                getattr(self, f"_{op}")()
            except Exception as exc:
                log.exception("%s: %s failed", self.id, op)
                self.state = "failed"
                self.log.write("error", device=self.id, error=f"{op}: {exc}")

    def _online(self) -> None:
        if self.state in ("online", "finished", "failed"):
            return
        self._retire()
        rebooted = self.state == "crashed"
        down = self._down = threading.Event()
        client = self.client_factory(
            self.settings, self.creds, self.data, sleep=lambda s: down.wait(max(0.0, s)) and None,
            shaper=self.shaper, on_progress=self._progress, after_compute=self._stretch, network=self.network,
            model_slots=self.model_slots, tick_s=IDLE_TICK_S)
        if client.finished:
            self.state = "finished"  # the store says the federation is over for this device
            return
        count_wire_bytes(client.link.client, self._count)  # every byte, retransmissions and MQTT framing included
        client.on_http_bytes = lambda n: self._count(n, "down")  # models over HTTP: the body bytes (headers not)
        self.client = client
        self.instances += 1
        client.start()
        self.state = "online"
        self.log.write("restart" if rebooted else "online", device=self.id, instance=self.instances,
                       done_round=client.stored.done_round)

    def _offline(self) -> None:
        if self.state == "crashed":
            self.state = "offline"
        if self.state != "online" or self.client is None:
            return
        self._down.set()
        self.client.stop()
        self.state = "offline"
        self.log.write("offline", device=self.id)

    def _crash(self) -> None:
        if self.state != "online" or self.client is None:
            return
        self._down.set()
        self.client.crash()
        self.state = "crashed"
        self.crashes += 1
        self.log.write("crash", device=self.id, crashes=self.crashes)

    def _retire(self) -> None:
        """The previous instance's local round (if any) ends before a new instance reads the disk."""
        old = self.client
        if old is not None:
            old.jobs.shutdown(wait=True)
            self.rounds_trained += old.rounds_trained
            self.client = None

    # ---- hooks (EdgeClient threads) -------------------------------------------------------------------
    def _count(self, nbytes: int, direction: str) -> None:
        client = self.client
        plan = client.plan if client is not None else None
        self.counter.add(plan.round if plan is not None else 0, direction, nbytes)

    def _stretch(self, kind: str, wall_s: float, cpu_s: float) -> None:
        extra = max(0.0, self.profile.slowdown * cpu_s - wall_s)
        self.log.write("compute", device=self.id, what=kind, cpu_s=round(cpu_s, 4), wall_s=round(wall_s, 4),
                       waited_s=round(extra, 4))
        if extra > 0:
            self._down.wait(extra)

    def _progress(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "finished":
            self.final_acc = float(info["acc"])
        self.log.write(kind, device=self.id, profile=self.profile.name, **info)

    # ---- polled by the host -------------------------------------------------------------------------
    def check(self) -> str | None:
        """Notice an instance that stopped by itself: ``finished`` or ``failed`` (else None)."""
        client = self.client
        if self.state != "online" or client is None or not client.wait(0):
            return None
        with self._lock:
            if self.state != "online" or self.client is not client:
                return None
            if client.error is not None:
                self.state = "failed"
                self.log.write("error", device=self.id, error=str(client.error))
            else:
                self.state = "finished" if client.finished else "offline"
            if self.state in ("finished", "failed"):  # done for good: let its memory go
                client.jobs.shutdown(wait=False)
                self.rounds_trained += client.rounds_trained
                self.client = None
        return self.state

    def connected(self) -> bool:
        client = self.client
        return client is not None and self.state == "online" and client.link.connected.is_set()

    def shutdown(self) -> None:
        """Stop cleanly (called at the end, from the host's thread)."""
        with self._lock:
            self._ops.clear()
        if self.state == "online" and self.client is not None:
            self._down.set()
            self.client.stop()
        if self.client is not None:
            self.client.jobs.shutdown(wait=True, cancel_futures=True)
            self.rounds_trained += self.client.rounds_trained
            self.client = None
