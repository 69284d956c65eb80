"""A live :class:`~coordinator.dashboard.fleet.FleetView`: an observer connection to the broker and a tail
of the run's metrics file, folded in a background thread.

The observer subscribes to the round plan, ``status/+`` and ``metrics/+`` (all its ACL lets it read) with
a clean session and no will, so watching leaves nothing behind on the broker. Either source is optional:
without credentials the view shows a finished run's folder; without a metrics file, the broker's view.
Consumers call :meth:`FleetWatch.snapshot` or wait for a change with :meth:`FleetWatch.wait_change`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol import Kind, Plan, Status, TopicError, Topics, WireError, WireLimits, decode_message
from protocol.metrics_schema import MetricsSchemaError, parse_lines
from transport.credentials import Credentials, mqtt_connect_settings
from transport.link import Connected, Disconnected, MqttLink, Received

from ..revocations import RevocationList
from .fleet import FleetView

__all__ = ["FleetWatch", "MetricsTail", "find_metrics"]

log = logging.getLogger(__name__)


class MetricsTail:
    """New records of a growing metrics file since the last call (a torn last line waits for its end);
    an unreadable record raises :class:`MetricsSchemaError` naming the line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._line = 1
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read(8 << 20)
        except FileNotFoundError:
            return []
        if not data:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        first, self._line = self._line, self._line + len(lines)
        return parse_lines([ln.decode("utf-8", "replace") for ln in lines], str(self.path), first)


def find_metrics(folder: Path) -> Path | None:
    """The metrics file of a run folder: ``metrics.jsonl`` (simulate, emulate, a coordinator's state folder)."""
    for cand in (folder / "metrics.jsonl", folder / "coordinator" / "metrics.jsonl"):
        if cand.is_file():
            return cand
    return None


class FleetWatch:
    def __init__(self, creds: Credentials | None, metrics: Path | None, *, stale_after_s: float = 30.0,
                 clock: Callable[[], float] = time.time, revoked_file: Path | None = None) -> None:
        if creds is not None and creds.role != "observer":  # a coordinator's would take over its session
            raise ValueError(f"credentials of {creds.username!r} are a {creds.role}'s; watching needs the "
                             f"observer's (BROKER_STATE/credentials/observer.toml)")
        self.creds, self.metrics_path, self.clock = creds, metrics, clock
        self.view = FleetView(stale_after_s)
        self.topics = Topics(creds.federation) if creds is not None else None
        self.limits = WireLimits()
        self.events: queue.Queue[Any] = queue.Queue()
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=True) if creds else None
        self.tail = MetricsTail(metrics) if metrics is not None else None
        # devices 'flayer broker revoke' shut out: shown as revoked (the list is read again when it changes)
        self.revocations = RevocationList(revoked_file) if revoked_file is not None else None
        self.connected = False
        self.broker_error: str | None = None
        self.metrics_error: str | None = None
        self.subscribed_at: float | None = None
        self.last_message_at = 0.0
        self.takeovers = 0  # disconnects right after connecting: another watcher with the same credentials
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> FleetWatch:
        if self.link is not None:
            self.link.start()
        self._thread = threading.Thread(target=self._loop, name="fleet-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.link is not None:
            self.link.stop(timeout=1.0)

    # ---- the fold (its own thread) ------------------------------------------------------------------
    def _loop(self) -> None:
        next_tail = 0.0
        while not self._stop.is_set():
            try:
                ev = self.events.get(timeout=0.1)
            except queue.Empty:
                ev = None
            with self._cond:
                before = self.view.version
                while ev is not None:
                    self._event(ev)
                    try:
                        ev = self.events.get_nowait()
                    except queue.Empty:
                        ev = None
                if time.monotonic() >= next_tail:
                    next_tail = time.monotonic() + 0.25
                    if self.tail is not None:
                        self._read_metrics()
                    self._read_revocations()
                if self.view.version != before:
                    self._cond.notify_all()

    def _read_revocations(self) -> None:
        if self.revocations is None:
            return
        revoked = set(self.revocations.refresh())
        if revoked != self.view.revoked:
            self.view.revoked = revoked
            self.view.version += 1

    def _read_metrics(self) -> None:
        assert self.tail is not None
        try:
            for rec in self.tail.read():
                self.view.on_record(rec)
        except MetricsSchemaError as exc:
            if self.metrics_error is None:
                log.error("%s", exc)
            self.metrics_error = str(exc)
            self.tail = None  # a file this version cannot read: stop reading it, say why
            self.view.version += 1

    def _event(self, ev: Any) -> None:
        if isinstance(ev, Connected):
            self.connected, self.broker_error = ev.ok, None if ev.ok else f"the broker refused the observer ({ev.reason})"
            if ev.ok and self.link is not None and self.topics is not None:
                self.link.subscribe([self.topics.round(), self.topics.all_status(), self.topics.all_metrics()])
                self.subscribed_at = self.clock()
            self.view.version += 1
        elif isinstance(ev, Disconnected):
            if self.connected and self.subscribed_at is not None and self.clock() - self.subscribed_at < 5.0:
                self.takeovers += 1
                if self.takeovers == 3:
                    log.warning("the broker keeps closing the observer's connection: another watcher (flayer "
                                "status or dashboard) uses the same observer credentials; one connection each")
            self.connected = False
            self.view.version += 1
        elif isinstance(ev, Received) and ev.payload and self.topics is not None:
            self.last_message_at = self.clock()
            try:
                parsed = self.topics.parse(ev.topic)
                if parsed.kind == "round":
                    _, plan = decode_message(ev.payload, self.limits, Kind.PLAN)
                    assert isinstance(plan, Plan)
                    self.view.on_plan(plan)
                elif parsed.kind == "status" and parsed.client is not None:
                    _, status = decode_message(ev.payload, self.limits, Kind.STATUS)
                    assert isinstance(status, Status)
                    self.view.on_status(parsed.client, status, self.clock(), ev.retain)
            except (TopicError, WireError) as exc:  # not ours to judge beyond skipping it
                log.debug("skipped %s: %s", ev.topic, exc)

    # ---- consumers ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            snap = self.view.snapshot(self.clock())
            snap["source"] = {
                "broker": None if self.creds is None else f"{self.creds.host}:{self.creds.port}",
                "federation": None if self.creds is None else self.creds.federation,
                "connected": self.connected, "broker_error": self.broker_error,
                "metrics": None if self.metrics_path is None else str(self.metrics_path),
                "metrics_error": self.metrics_error}
            return snap

    def wait_change(self, version: int, timeout: float) -> int:
        """Block until the view's version differs from ``version`` (or ``timeout``); returns the version."""
        with self._cond:
            self._cond.wait_for(lambda: self.view.version != version, timeout)
            return self.view.version

    def settled(self, quiet_s: float = 0.5) -> bool:
        """Connected, subscribed, and no message for ``quiet_s``: the retained burst is in."""
        return (self.subscribed_at is not None
                and self.clock() - max(self.subscribed_at, self.last_message_at) >= quiet_s)
