"""The launcher's view of a running fleet, folded from the event files of its processes.

:class:`FleetProgress` takes events (see :mod:`emulator.events`) in any order of files and keeps:
per round, what the coordinator decided (selected, accepted, accuracy, why it closed) with the
number of devices online when it opened and closed, and the bytes the devices moved over their
emulated links for that round (model chunks down, update chunks up, re-sends included); per device,
its profile, lifetimes, crashes, trained rounds and final personal accuracy; per worker, its
memory, threads and connections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceView", "FleetProgress", "round_row"]


@dataclass
class DeviceView:
    profile: str = "?"
    online: int = 0
    offline: int = 0
    crashes: int = 0
    restarts: int = 0
    trained: list[int] = field(default_factory=list)  # rounds (versions) whose local round reported its end
    acked: set[int] = field(default_factory=set)  # rounds whose update the coordinator acknowledged as accepted
    final_acc: float | None = None
    cpu_s: float = 0.0
    waited_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        """Updates the coordinator accepted: one per acknowledged round (a re-sent update's ``duplicate``
        ack is the same update)."""
        return len(self.acked)

    def trained_rounds(self) -> list[int]:
        """The rounds this device trained: those whose local round reported its end, and those whose update
        was accepted -- an instance stopped (offline) between saving its upload and reporting the round
        leaves no ``trained`` event, and the next instance re-sends the stored upload."""
        return sorted(set(self.trained) | self.acked)


class FleetProgress:
    def __init__(self, profile_of: Mapping[str, str] | None = None) -> None:
        self.devices: dict[str, DeviceView] = {d: DeviceView(p) for d, p in (profile_of or {}).items()}
        self.opens: dict[int, dict[str, Any]] = {}
        self.records: dict[int, dict[str, Any]] = {}
        self.online_at_close: dict[int, int] = {}
        self.bytes: dict[str, dict[str, dict[str, int]]] = {}  # worker -> round -> {up, down}
        self.stats: dict[str, dict[str, Any]] = {}
        self.peak_rss_mb: dict[str, float] = {}
        self.max_connected: dict[str, int] = {}
        self.coordinator_done: dict[str, Any] | None = None
        self.online_now = 0
        self.waiting: dict[str, Any] | None = None
        self.accepted_live: dict[int, int] = {}
        # worker -> its start event (pid, devices, memory before)
        self.workers: dict[str, dict[str, Any]] = {}
        self.wrap_up: dict[str, dict[str, Any]] = {}  # worker -> its wrap-up event (memory after the rounds)

    def device(self, dev: str) -> DeviceView:
        return self.devices.setdefault(dev, DeviceView())

    def feed(self, ev: Mapping[str, Any]) -> str | None:
        """Fold one event; returns its kind."""
        kind = ev.get("kind")
        dev = ev.get("device")
        if kind == "open":
            r = int(ev["round"])
            self.opens[r] = dict(ev)
            self.online_now = int(ev.get("online", 0))
        elif kind == "round":
            rec = ev["record"]
            self.records[int(rec["round"])] = rec
            self.online_at_close[int(rec["round"])] = int(ev.get("online", 0))
            self.online_now = int(ev.get("online", 0))
        elif kind == "accepted":
            self.accepted_live[int(ev["round"])] = int(ev["accepted"])
        elif kind == "waiting":
            self.waiting = dict(ev)
            self.online_now = int(ev.get("online", 0))
        elif kind == "done":
            self.coordinator_done = dict(ev)
        elif kind == "bytes":
            self.bytes[str(ev["worker"])] = ev["by_round"]
        elif kind == "worker":
            self.workers[str(ev["worker"])] = dict(ev)
        elif kind == "wrap_up":
            self.wrap_up[str(ev["worker"])] = dict(ev)
        elif kind == "stats":
            w = str(ev["worker"])
            self.stats[w] = dict(ev)
            self.peak_rss_mb[w] = max(self.peak_rss_mb.get(w, 0.0), float(ev.get("peak_rss_mb", 0.0)))
            self.max_connected[w] = max(self.max_connected.get(w, 0), int(ev.get("connected", 0)))
        elif dev is not None:
            self._device_event(str(kind), self.device(str(dev)), ev)
        return str(kind) if kind is not None else None

    def _device_event(self, kind: str, d: DeviceView, ev: Mapping[str, Any]) -> None:
        if kind in ("online", "restart"):
            d.online += 1
            d.restarts += kind == "restart"
        elif kind == "offline":
            d.offline += 1
        elif kind == "crash":
            d.crashes += 1
        elif kind == "trained":
            d.trained.append(int(ev["round"]))
            if ev.get("profile"):
                d.profile = str(ev["profile"])
        elif kind == "ack" and ev.get("status") in ("accepted", "duplicate"):
            d.acked.add(int(ev["round"]))
        elif kind == "finished":
            d.final_acc = float(ev["acc"])
        elif kind == "compute":
            d.cpu_s += float(ev.get("cpu_s", 0.0))
            d.waited_s += float(ev.get("waited_s", 0.0))
        elif kind == "error":
            d.errors.append(str(ev.get("error")))

    def link_bytes(self, r: int) -> tuple[int, int]:
        """(up, down) bytes the devices moved for round ``r`` (all workers)."""
        up = down = 0
        for by_round in self.bytes.values():
            slot = by_round.get(str(r), {})
            up += int(slot.get("up", 0))
            down += int(slot.get("down", 0))
        return up, down

    def rows(self) -> list[dict[str, Any]]:
        return [round_row(r, self.records[r], self.opens.get(r, {}), self.online_at_close.get(r),
                          self.link_bytes(r))
                for r in sorted(self.records)]

    def totals(self) -> dict[str, Any]:
        devs = self.devices.values()
        return {"crashes": sum(d.crashes for d in devs), "restarts": sum(d.restarts for d in devs),
                "offline_events": sum(d.offline for d in devs), "errors": sum(len(d.errors) for d in devs),
                "trained_updates": sum(len(d.trained_rounds()) for d in devs)}


def round_row(r: int, rec: Mapping[str, Any], opened: Mapping[str, Any], online_close: int | None,
              link: tuple[int, int]) -> dict[str, Any]:
    """One line of the emulator's ``rounds.jsonl`` (and of the final table)."""
    return {"round": r, "selected": len(rec.get("selected", [])), "reported": int(rec.get("accepted", 0)),
            "online_open": opened.get("online"), "online_close": online_close, "acc": rec.get("acc"),
            "train_loss": rec.get("train_loss"), "mb_up": link[0] / 1e6, "mb_down": link[1] / 1e6,
            "coordinator_mb_in": int(rec.get("bytes_in", 0)) / 1e6, "rejected": dict(rec.get("rejected", {})),
            "wall_s": float(rec.get("wall_s", 0.0)), "closed": rec.get("closed", ""),
            "selected_ids": list(rec.get("selected", []))}
