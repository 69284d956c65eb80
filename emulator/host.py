"""Many emulated devices in one process, driven by their availability timelines.

:class:`FleetHost` merges every device's timeline (:func:`emulator.availability.device_timeline`)
into one clock-ordered heap and posts each event to its device when it is due (time 0 = when the
host starts). Transitions run on a small pool, queued per device. Every second it notices devices
whose client stopped by itself (finished after the final plan, or failed) and writes the byte
counters; every few seconds a ``stats`` event (memory, threads, connections).

``wrap_up()`` (the federation is over): timelines stop, and every device that has not finished
comes online once, to fetch the final model and save its personal model -- ``wrap_batch`` at a time
(connections), and at most the worker's model slots (:mod:`emulator.slots`) holding a model at once, so
a large fleet does not hold every final model in memory at once: devices that stayed online through the
rounds take the final plan all together, and wait for a slot too. The host returns from
:meth:`run` when every device finished or failed, or after :meth:`stop`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .device import ByteCounter, EmulatedDevice
from .events import EventLog
from .slots import ModelSlots

__all__ = ["FleetHost", "process_memory"]

log = logging.getLogger(__name__)


def process_memory() -> dict[str, float]:
    """Resident and peak resident memory of this process, MB (Linux /proc; zeros elsewhere)."""
    out = {"rss_mb": 0.0, "peak_rss_mb": 0.0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                out["peak_rss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


class FleetHost:
    def __init__(self, devices: Sequence[EmulatedDevice], timelines: Sequence[Iterator[tuple[float, str]]],
                 log_: EventLog, counter: ByteCounter, pool: ThreadPoolExecutor, name: str = "worker",
                 stats_every_s: float = 5.0, wrap_batch: int = 32, slots: ModelSlots | None = None) -> None:
        self.devices, self.timelines = list(devices), list(timelines)
        self.log, self.counter, self.pool, self.name = log_, counter, pool, name
        self.stats_every_s = stats_every_s
        self.wrap_batch = wrap_batch
        self.slots = slots
        self._stop = threading.Event()
        self._wrap = threading.Event()
        self._wrapped = False
        self._heap: list[tuple[float, int, int, str]] = []
        self._seq = itertools.count()

    def wrap_up(self) -> None:
        """The federation is over (safe from a signal handler)."""
        self._wrap.set()  # run() looks at least every 0.2 s

    def stop(self) -> None:
        self._stop.set()

    def _push_next(self, i: int) -> None:
        nxt = next(self.timelines[i], None)
        if nxt is not None:
            heapq.heappush(self._heap, (nxt[0], next(self._seq), i, nxt[1]))

    def run(self) -> dict[str, int]:
        """Run until every device finished or failed (or stop()); returns the count per state."""
        t0 = time.monotonic()
        for i in range(len(self.devices)):
            self._push_next(i)
        next_poll = next_stats = 0.0
        waiting: list[EmulatedDevice] = []
        try:
            while not self._stop.is_set():
                now = time.monotonic() - t0
                if self._wrap.is_set() and not self._wrapped:
                    self._wrapped = True
                    self._heap.clear()
                    self.log.write("wrap_up", worker=self.name,
                                   **{k: round(v, 1) for k, v in process_memory().items()})
                    waiting = [d for d in self.devices if d.state in ("offline", "crashed")]
                if self._wrapped and waiting:
                    busy = sum(d.state == "online" for d in self.devices)
                    for _ in range(max(0, self.wrap_batch - busy)):
                        if waiting:
                            waiting.pop(0).post("online")
                while self._heap and self._heap[0][0] <= now:
                    _, _, i, event = heapq.heappop(self._heap)
                    self.devices[i].post(event)
                    self._push_next(i)
                if now >= next_poll:
                    next_poll = now + 1.0
                    if self._poll():
                        break
                if now >= next_stats:
                    next_stats = now + self.stats_every_s
                    self._stats()
                wait = min(0.2, (self._heap[0][0] - now) if self._heap else 0.2)
                self._stop.wait(max(0.01, wait))
        finally:
            self._shutdown()
        return self.counts()

    def _poll(self) -> bool:
        for d in self.devices:
            d.check()
        if self.counter.changed:
            self.log.write("bytes", worker=self.name, by_round=self.counter.snapshot())
        return all(d.state in ("finished", "failed") for d in self.devices)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.devices:
            out[d.state] = out.get(d.state, 0) + 1
        return out

    def _stats(self) -> None:
        self.log.write("stats", worker=self.name, devices=len(self.devices), threads=threading.active_count(),
                       connected=sum(d.connected() for d in self.devices), states=self.counts(),
                       **(self.slots.snapshot() if self.slots is not None else {}),
                       **{k: round(v, 1) for k, v in process_memory().items()})

    def _shutdown(self) -> None:
        """Stop every client still running, cleanly, a few at a time; final counters and stats."""
        list(self.pool.map(lambda d: d.shutdown(), self.devices))
        self.log.write("bytes", worker=self.name, by_round=self.counter.snapshot())
        self._stats()
        self.log.write("host_done", worker=self.name, states=self.counts(),
                       trained={d.id: d.rounds_trained for d in self.devices},
                       crashes={d.id: d.crashes for d in self.devices if d.crashes})
