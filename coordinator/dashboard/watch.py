"""A live :class:`~coordinator.dashboard.fleet.FleetView`: an observer connection to the broker and a tail
of the run's metrics file, folded in a background thread.

The observer subscribes to the round plan, ``status/+`` and ``metrics/+`` (all its ACL lets it read) with
a clean session and no will, so watching leaves nothing behind on the broker. Either source is optional:
without credentials the view shows a finished run's folder; without a metrics file, the broker's view.
Consumers call :meth:`FleetWatch.snapshot` or wait for a change with :meth:`FleetWatch.wait_change`.

The fold, so that a flood of messages never starves the consumers:

1. the link's callback only enqueues, into a queue of at most ``MAX_QUEUED`` events; a message that
   finds it full is dropped and counted (``dropped``; a device's next heartbeat brings its state again),
   a connection event waits for room;
2. the fold thread takes at most ``BATCH`` events at a time and decodes them, reads the metrics file's
   new lines and the revocation list, all outside the lock;
3. only then it takes the lock, applies what it decoded to the view and notifies the waiting consumers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol import (
    Kind,
    PeerTrust,
    Plan,
    Status,
    TopicError,
    Topics,
    VerifyKey,
    WireError,
    WireLimits,
    decode_message,
)
from protocol.metrics_schema import MetricsSchemaError, parse_lines
from transport.credentials import Credentials, mqtt_connect_settings
from transport.link import Connected, Disconnected, MqttLink, Received

from ..revocations import RevocationList
from .fleet import FleetView

__all__ = ["FleetWatch", "MetricsTail", "find_metrics"]

log = logging.getLogger(__name__)
MAX_QUEUED = 50_000  # events waiting for the fold (rule 1)
BATCH = 1_000  # events taken, decoded and applied per hold of the lock (rule 2)


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
        # the plan shown is one the coordinator signed (the key an observer's credentials carry); statuses are
        # shown as delivered: an observer holds no device's key (docs/explanation/security.md, "Watchers")
        self.trust = PeerTrust(creds.federation, VerifyKey.from_text(creds.coordinator_key)) \
            if creds is not None and creds.coordinator_key else None
        self.refused = 0  # plans not signed by the coordinator's key
        self.limits = WireLimits()
        self.events: queue.Queue[Any] = queue.Queue(MAX_QUEUED)
        self.dropped = 0  # messages dropped because the queue was full (rule 1)
        self.link = MqttLink(mqtt_connect_settings(creds), self.enqueue, clean_session=True) if creds else None
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

    # ---- the fold (its own thread; module docstring, rules 1-3) -------------------------------------
    def enqueue(self, ev: Any) -> None:
        """The link's callback (rule 1): never blocks on a message, never drops a connection event."""
        if not isinstance(ev, Received):
            try:
                self.events.put(ev, timeout=5.0)
            except queue.Full:  # the fold thread has stopped
                log.warning("fleet watch: dropped %s (the fold has stopped)", type(ev).__name__)
            return
        try:
            self.events.put_nowait(ev)
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 1_000) or self.dropped % 100_000 == 0:
                log.warning("fleet watch: %d message(s) dropped: more than %d waiting to be shown", self.dropped,
                            MAX_QUEUED)

    def _loop(self) -> None:
        next_tail = 0.0
        while not self._stop.is_set():
            next_tail = self.fold_once(next_tail)

    def fold_once(self, next_tail: float = 0.0, wait_s: float = 0.1) -> float:
        """One pass (rules 2 and 3): up to ``BATCH`` events, and the files when ``next_tail`` is due;
        returns when the files are due next."""
        taken = self._take(wait_s)
        decoded = [d for ev in taken if (d := self._decode(ev)) is not None]
        records: list[dict[str, Any]] = []
        metrics_error: MetricsSchemaError | None = None
        revoked: set[str] | None = None
        if time.monotonic() >= next_tail:
            next_tail = time.monotonic() + 0.25
            if self.tail is not None:
                try:
                    records = self.tail.read()
                except MetricsSchemaError as exc:
                    metrics_error = exc
            if self.revocations is not None:
                revoked = set(self.revocations.refresh())
        with self._cond:
            before = self.view.version
            for item in decoded:
                self._apply(item)
            for rec in records:
                self.view.on_record(rec)
            if metrics_error is not None:
                self._metrics_failed(metrics_error)
            if revoked is not None and revoked != self.view.revoked:
                self.view.revoked = revoked
                self.view.version += 1
            if self.view.version != before:
                self._cond.notify_all()
        return next_tail

    def _take(self, wait_s: float) -> list[Any]:
        try:
            taken = [self.events.get(timeout=wait_s)]
        except queue.Empty:
            return []
        while len(taken) < BATCH:
            try:
                taken.append(self.events.get_nowait())
            except queue.Empty:
                break
        return taken

    def _metrics_failed(self, exc: MetricsSchemaError) -> None:
        if self.metrics_error is None:
            log.error("%s", exc)
        self.metrics_error = str(exc)
        self.tail = None  # a file this version cannot read: stop reading it, say why
        self.view.version += 1

    def _decode(self, ev: Any) -> tuple[Any, ...] | None:
        """A message as what the view takes, decoded outside the lock (None: nothing to show)."""
        if not isinstance(ev, Received):
            return (ev,)
        if not ev.payload or self.topics is None:
            return None
        now = self.clock()
        try:
            parsed = self.topics.parse(ev.topic)
            if parsed.kind == "round":
                try:
                    _, plan = decode_message(ev.payload, self.limits, Kind.PLAN, self.trust)
                except WireError:
                    self.refused += 1
                    raise
                assert isinstance(plan, Plan)
                return ("plan", now, plan)
            if parsed.kind == "status" and parsed.client is not None:
                _, status = decode_message(ev.payload, self.limits, Kind.STATUS)
                assert isinstance(status, Status)
                return ("status", now, parsed.client, status, ev.retain)
        except (TopicError, WireError) as exc:  # not ours to judge beyond skipping it
            log.debug("skipped %s: %s", ev.topic, exc)
        return ("message", now)

    def _apply(self, item: tuple[Any, ...]) -> None:
        """One decoded event into the view (under the lock)."""
        ev = item[0]
        if isinstance(ev, str):
            self.last_message_at = item[1]
            if ev == "plan":
                self.view.on_plan(item[2])
            elif ev == "status":
                self.view.on_status(item[2], item[3], item[1], item[4])
        elif isinstance(ev, Connected):
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
