"""The fleet as an operator sees it, folded from what a read-only observer receives: the retained round
plan, every device's retained status (and heartbeats), and the run's metrics file.

:class:`FleetView` is pure (no network, no clock of its own): feed it statuses, plans and metrics
records, then ask :meth:`FleetView.snapshot` for a JSON-able picture at a given time. ``flayer status``
prints it; ``flayer dashboard`` pushes it to the page.

A device's state, in this order of precedence:

1. ``revoked``: its credentials were revoked (a set the caller passes);
2. ``offline``: its last status says so (the broker's last will), or it is older than ``stale_after_s``;
3. ``late``: it is selected in the open round, the round's deadline has passed and it has not finished;
4. otherwise what its last status says: ``online`` (connected, fetching the model), ``training``,
   ``uploading`` or ``idle`` (done with the round, or not selected);
5. ``unknown``: the metrics file names it but no status was seen; ``offline`` when that file says the run
   ended (a finished run's folder).

A status is a device's word: the fields shown from its ``info`` (``link_kbps`` a finite number >= 0, ``device`` a
short text) are checked per device; one that is not what it should be is left out and the device's row says why
(``invalid``), so one device's status cannot stop ``flayer status``, ``--watch`` or the dashboard for the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.device_privacy import device_privacy
from protocol import Plan, Status

__all__ = ["STATES", "FleetView"]

STATES = ("online", "idle", "training", "uploading", "late", "offline", "revoked", "unknown")
MAX_ROUNDS = 2000  # rounds kept for the charts
MAX_REFUSALS = 50


@dataclass
class _Device:
    status: str = "unknown"
    last_seen: float | None = None
    round: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    accepted: int = 0
    last_result: str = ""
    last_result_round: int = 0
    acc: float | None = None
    invalid: str = ""  # why a field of its last status was left out (module docstring)


def _checked_info(info: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``info`` without the shown fields that are not what they should be, and why (empty: all good)."""
    out, bad = dict(info), []
    kbps = out.get("link_kbps")
    if kbps is not None and (isinstance(kbps, bool) or not isinstance(kbps, (int, float)) or not math.isfinite(kbps)
                             or kbps < 0):
        bad.append(f"link_kbps {str(kbps)[:20]!r} is not a number >= 0")
        del out["link_kbps"]
    hw = out.get("device")
    if hw is not None and not (isinstance(hw, str) and len(hw) <= 64 and hw.isprintable()):
        bad.append(f"device {str(hw)[:20]!r} is not a short text")
        del out["device"]
    return out, "; ".join(bad)


class FleetView:
    def __init__(self, stale_after_s: float = 30.0, revoked: Iterable[str] = ()) -> None:
        self.stale_after_s = stale_after_s
        self.revoked = set(revoked)
        self.devices: dict[str, _Device] = {}
        self.plan: Plan | None = None
        self.rounds: list[dict[str, Any]] = []
        self.refusals: list[dict[str, Any]] = []
        self.run: dict[str, Any] = {}
        self.end: dict[str, Any] | None = None
        self.version = 0  # bumped on every change (the dashboard pushes when it moves)

    # ---- feeding -----------------------------------------------------------------------------------
    def on_status(self, client: str, status: Status, now: float, retained: bool = False) -> None:
        """A device's status; a retained one is only as fresh as the time it carries (as the coordinator's
        registry judges it)."""
        d = self.devices.setdefault(client, _Device())
        d.status, d.round = status.state, status.round
        d.info, d.invalid = _checked_info(status.info)
        d.last_seen = min(now, status.time) if retained else now
        self.version += 1

    def on_plan(self, plan: Plan) -> None:
        self.plan = plan
        for c in plan.selected:
            self.devices.setdefault(c, _Device())
        self.version += 1

    def on_record(self, rec: Mapping[str, Any]) -> None:
        """A record of the metrics schema (validated by the reader)."""
        kind = rec.get("kind")
        if kind == "run":
            self.run, self.end = dict(rec), None
        elif kind == "end":
            self.end = dict(rec)
        elif kind == "round":
            self._round(rec)
        self.version += 1

    def _round(self, rec: Mapping[str, Any]) -> None:
        r = int(rec["round"])
        self.rounds = [x for x in self.rounds if x["round"] != r][-(MAX_ROUNDS - 1):]
        self.rounds.append({"round": r, "acc": rec["acc"], "bytes_up": rec["bytes_up"],
                            "bytes_down": rec["bytes_down"], "selected": len(rec["selected"]),
                            "reported": rec["reported"], "late": rec["late"], "refused": dict(rec["refused"]),
                            "wall_s": rec["wall_s"], "closed": rec["closed"], "time": rec["time"],
                            "epsilon": rec.get("epsilon"), "delta": rec.get("delta"),  # private runs
                            "epsilon_coordinator": rec.get("epsilon_coordinator"),
                            "dp_max_participations": rec.get("dp_max_participations"),  # the schema it assumes
                            "dp_min_separation": rec.get("dp_min_separation")})
        for row in rec["devices"]:
            d = self.devices.setdefault(row["id"], _Device())
            if row["result"] == "accepted":
                d.accepted += 1
            d.last_result, d.last_result_round = row["result"], r
            if row.get("acc") is not None:
                d.acc = row["acc"]
        for ref in rec.get("refusals", []):
            self.refusals.append({"round": r, "reason": ref["reason"], "detail": ref.get("detail", ""),
                                  "device": ref.get("device", ""), "time": rec["time"]})
        self.refusals = self.refusals[-MAX_REFUSALS:]

    # ---- reading -----------------------------------------------------------------------------------
    def state_of(self, client: str, now: float) -> str:
        d = self.devices[client]
        if client in self.revoked:
            return "revoked"
        if d.last_seen is None:
            return "offline" if self.end is not None else "unknown"
        if d.status == "offline" or now - d.last_seen > self.stale_after_s:
            return "offline"
        p = self.plan
        if (p is not None and p.phase == "train" and client in p.selected and now > p.deadline
                and not (d.round == p.round and d.status == "idle")):
            return "late"
        return d.status

    def progress(self, now: float) -> dict[str, Any]:
        """The open round: selected devices by state, and how many are done (idle at this round)."""
        p = self.plan
        if p is None:
            return {"round": None, "phase": None, "rounds": self.run.get("rounds"), "selected": 0, "done": 0,
                    "by_state": {}, "deadline_in_s": None}
        by_state: dict[str, int] = {}
        done = 0
        for c in p.selected:
            d = self.devices.get(c)
            state = self.state_of(c, now) if d is not None else "unknown"
            if d is not None and d.round == p.round and d.status == "idle" and state != "offline":
                state, done = "done", done + 1
            by_state[state] = by_state.get(state, 0) + 1
        return {"round": p.round, "phase": p.phase, "rounds": p.rounds or self.run.get("rounds"),
                "selected": len(p.selected), "done": done, "by_state": dict(sorted(by_state.items())),
                "deadline_in_s": round(p.deadline - now, 1) if p.phase == "train" else None}

    def device_rows(self, now: float) -> list[dict[str, Any]]:
        p = self.plan
        rows = []
        for c in sorted(self.devices):
            d = self.devices[c]
            rows.append({"id": c, "state": self.state_of(c, now), "last_seen": d.last_seen,
                         "last_seen_s": None if d.last_seen is None else round(max(0.0, now - d.last_seen), 1),
                         "link_kbps": d.info.get("link_kbps"), "round": d.round, "accepted": d.accepted,
                         "last_result": d.last_result, "last_result_round": d.last_result_round, "acc": d.acc,
                         "selected": bool(p is not None and c in p.selected), "hardware": d.info.get("device"),
                         "invalid": d.invalid})
        return rows

    def snapshot(self, now: float) -> dict[str, Any]:
        rows = self.device_rows(now)
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        last = self.rounds[-1] if self.rounds else None
        return {"time": now, "version": self.version, "run": self.run, "end": self.end,
                "progress": self.progress(now), "states": counts, "devices": rows, "rounds": self.rounds,
                "refusals": list(reversed(self.refusals)), "last_round": last,
                "updates_accepted": sum(r["accepted"] for r in rows),
                "device_privacy": device_privacy(d.info for d in self.devices.values())}  # private runs
