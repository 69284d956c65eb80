"""The coordinator's Prometheus metrics (docs/reference/metrics.md, "Prometheus"; docs/howto/service.md).

One rule keeps the scrape and the coordinator's own files from disagreeing: everything is fed on the
coordinator's worker thread, from the values it records, and the HTTP server (:class:`MetricsServer`)
only renders the registry (``prometheus_client``'s metric objects lock their own values).

1. Counted where the coordinator counts. ``flayer_updates_refused_total{reason}`` and
   ``flayer_updates_clipped_total`` are the coordinator's cumulative counters (the ones in
   ``metrics.jsonl``'s ``counters`` field and the checkpoint, so they continue across a restart),
   copied by :meth:`FleetMetrics.sync`; ``reason`` is one of :data:`REFUSAL_REASONS`, a closed set, every
   one exported from the start (at 0).
2. Per closed round, from the record written to ``metrics.jsonl`` (:meth:`FleetMetrics.round_closed`):
   ``flayer_rounds_total`` (it starts at the checkpoint's round, so it equals the round lines of the
   file), ``flayer_round_duration_seconds`` (``wall_s``), ``flayer_updates_accepted_total``,
   ``flayer_bytes_up_total`` / ``flayer_bytes_down_total``, ``flayer_last_round_devices{result}``,
   ``flayer_staleness_mean`` (asynchronous rounds) and ``flayer_last_round_closed_timestamp_seconds``.
3. Gauges of the moment, at most every ``min_interval_s`` and when a round opens or closes: the open
   round, devices online / selected / reporting by their ``[edge] label`` (a device's profile in the
   emulator), the receive queue's fill, the round's norm bound (+Inf: none).
4. Bounded labels, chosen again at every sync from the devices online now: device ids never become label
   values; a label a device reports is kept when it matches :data:`LABEL_RE` and is among the
   :data:`MAX_LABELS` labels carried by the most online devices (ties by name); the rest count as
   ``other`` (none: ``none``), and a label no online device carries any more leaves the gauges. A device
   that keeps changing its label holds one label at a time, so it cannot push the others out.

5. Privacy, private runs only (the gauges appear with the first private round record or device ledger):
   ``flayer_privacy_epsilon{schema}`` (against readers of the models and plans) and
   ``flayer_privacy_epsilon_coordinator{schema}`` (against the coordinator) and ``flayer_privacy_delta`` from
   each closed round's record (+Inf: no guarantee); ``schema`` is the participation schema the figures assume
   (``every round``, or ``at most k rounds, b apart``), one series at a time. The devices' own ledgers as their
   statuses report them (:mod:`coordinator.device_privacy`): ``flayer_device_epsilon{stat="min|median|max",
   against}``, ``flayer_devices_at_budget`` and ``flayer_devices_counting_privacy``; ``against`` is the party a
   device's figure holds against in this federation's mode (:mod:`coordinator.privacy_metrics`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter as TallyCounter
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flayer.files import private_dir
from protocol.messages import DEVICE_LABEL
from protocol.metrics_schema import DEVICE_RESULTS
from transport.access import REQUEST_TIMEOUT_S, host_allows, served_names, token_allows, token_for
from transport.hosts import is_loopback

from .device_privacy import device_privacy
from .http_bounds import BoundedHandler, BoundedHTTPServer
from .intake import REJECTION_COUNTERS
from .open_round import OpenRound
from .privacy_metrics import PrivacyGauges
from .receive import ReceiveQueue
from .registry import DeviceRegistry

__all__ = ["LABEL_RE", "MAX_LABELS", "REFUSAL_REASONS", "FleetMetrics", "FleetView", "MetricsServer", "device_label", "read_token"]

log = logging.getLogger(__name__)

# every counter name the coordinator refuses something under: the intake's and the inbox's
# (coordinator.intake), and messages of revoked devices (coordinator.server)
REFUSAL_REASONS: tuple[str, ...] = (*REJECTION_COUNTERS, "revoked")
NOT_REFUSALS = ("clipped", "secure_abandoned")  # counted, but no update refused (accepted; a round abandoned)
LABEL_RE = DEVICE_LABEL  # what a device's [edge] label may be (protocol.messages)
MAX_LABELS = 32
NO_LABEL, OTHER_LABEL = "none", "other"


class FleetView(Protocol):
    """What :meth:`FleetMetrics.sync` reads of the coordinator (:class:`coordinator.server.Coordinator`)."""

    counters: TallyCounter[str]
    events: ReceiveQueue
    clock: Callable[[], float]
    registry: DeviceRegistry

    @property
    def open(self) -> OpenRound | None: ...

    def online(self, now: float) -> list[str]: ...
# the text format every Prometheus reads (Debian 12's 2.42 too); the names here need nothing newer
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TOKEN_FILE = "metrics.token"  # in the state folder: the generated token, off loopback without metrics_token_file
DURATION_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, float("inf"))


def device_label(info: Mapping[str, object] | None) -> str:
    """The label a device reports in its status (``[edge] label``), or ``none`` (rule 4)."""
    value = (info or {}).get("label")
    return value if isinstance(value, str) and LABEL_RE.fullmatch(value) else NO_LABEL


class FleetMetrics:
    """The registry and the coordinator's side of it (module docstring); every method but
    :attr:`registry` reads runs on the coordinator's worker thread. ``privacy_mode``: the federation's
    ``[privacy] mode`` when private (the ``against`` label of the devices' epsilon)."""

    def __init__(self, federation: str, strategy: str, mode: str, deadline_s: float, queue_capacity: int,
                 max_staleness: int | None = None, privacy_mode: str = "central", min_interval_s: float = 0.5) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.privacy = PrivacyGauges(self.registry, privacy_mode)  # rule 5: created with the first private record
        self.min_interval_s = min_interval_s
        self._synced_at = -math.inf
        self._open_number = 0
        self._labels: set[str] = set()  # the label values exported by the latest sync (rule 4)
        r = self.registry
        Gauge("flayer_info", "The federation this coordinator runs (value 1)", ["federation", "strategy", "mode"],
              registry=r).labels(federation, strategy, mode).set(1)
        self.rounds = Counter("flayer_rounds", "Rounds closed (asynchronous: model versions): the round lines "
                              "of metrics.jsonl", registry=r)
        self.duration = Histogram("flayer_round_duration_seconds", "Wall time of each round closed by this "
                                  "process, open to close", buckets=DURATION_BUCKETS, registry=r)
        self.accepted = Counter("flayer_updates_accepted", "Updates folded into closed rounds by this process",
                                registry=r)
        self.refused = Counter("flayer_updates_refused", "Refused updates and messages, by the coordinator's "
                               "counter (cumulative, as in metrics.jsonl's counters)", ["reason"], registry=r)
        self.secure_abandoned = Counter("flayer_secure_rounds_abandoned", "Secure rounds abandoned, by kind of "
                                        "reason (flayer.engine.secure.ABANDON_KINDS)", ["reason"], registry=r)
        self.clipped = Counter("flayer_updates_clipped", "Updates scaled down to the norm bound (policy clip)",
                               registry=r)
        self.bytes_up = Counter("flayer_bytes_up", "Bytes the coordinator's connection received while rounds "
                                "were open (the rounds' bytes_up)", registry=r)
        self.bytes_down = Counter("flayer_bytes_down", "Bytes the coordinator's connection sent while rounds "
                                  "were open (the rounds' bytes_down)", registry=r)
        self.last_devices = Gauge("flayer_last_round_devices", "The selected devices of the latest closed round "
                                  "by result", ["result"], registry=r)
        self.last_closed = Gauge("flayer_last_round_closed_timestamp_seconds", "When the latest round closed "
                                 "(Unix time; the start until one did)", registry=r)
        Gauge("flayer_deadline_seconds", "A round's deadline (deadline_s)", registry=r).set(deadline_s)
        self.open_round = Gauge("flayer_open_round", "The round taking updates (0: none)", registry=r)
        self.online = Gauge("flayer_devices_online", "Devices online, revoked ones left out, by label",
                            ["label"], registry=r)
        self.selected = Gauge("flayer_devices_selected", "Devices selected for the open round, by label",
                              ["label"], registry=r)
        self.reporting = Gauge("flayer_devices_reporting", "Devices whose update the open round accepted, by "
                               "label", ["label"], registry=r)
        self.queue = Gauge("flayer_receive_queue_bytes", "Bytes waiting in the receive queue", registry=r)
        Gauge("flayer_receive_queue_capacity_bytes", "The receive queue's bound (queue_bytes)",
              registry=r).set(queue_capacity)
        self.norm_bound = Gauge("flayer_norm_bound", "The open round's L2 bound on an update (+Inf: none)",
                                registry=r)
        self.staleness: Gauge | None = None
        if max_staleness is not None:
            Gauge("flayer_max_staleness", "Versions an asynchronous update may lag (max_staleness)",
                  registry=r).set(max_staleness)
            self.staleness = Gauge("flayer_staleness_mean", "Mean staleness of the updates of the latest "
                                   "version", registry=r)
        self._counted: dict[str, int] = {}
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        for result in DEVICE_RESULTS:
            self.last_devices.labels(result)
        self.norm_bound.set(math.inf)

    # ---- fed by the coordinator (worker thread) --------------------------------------------------------
    def restored(self, done_round: int, now: float) -> None:
        """At the start: the rounds the checkpoint holds (rule 2)."""
        if done_round > 0:
            self.rounds.inc(done_round)
        self.last_closed.set(now)

    def round_closed(self, record: Mapping[str, Any]) -> None:
        """A closed round's record, the one just written to ``metrics.jsonl`` (rule 2)."""
        self.rounds.inc()
        self.duration.observe(max(0.0, float(record["wall_s"])))
        self.accepted.inc(int(record["accepted"]))
        self.bytes_up.inc(max(0, int(record["bytes_up"])))
        self.bytes_down.inc(max(0, int(record["bytes_down"])))
        results = TallyCounter(str(d.get("result")) for d in record.get("devices", ()))
        for result in DEVICE_RESULTS:
            self.last_devices.labels(result).set(results.get(result, 0))
        if self.staleness is not None and record.get("staleness_mean") is not None:
            self.staleness.set(float(record["staleness_mean"]))
        self.last_closed.set(float(record["time"]))
        if record.get("secure_abandoned_kind"):
            self.secure_abandoned.labels(str(record["secure_abandoned_kind"])).inc()
        self.privacy.round_closed(record)  # rule 5: a private round's epsilon
        self._synced_at = -math.inf  # the gauges follow at the next sync

    def sync(self, coord: FleetView, force: bool = False) -> None:
        """Copy the coordinator's counters and gauges (rules 1 and 3), at most every ``min_interval_s``
        unless ``force``; ``coord`` is :class:`coordinator.server.Coordinator`, read on its own thread."""
        mono, rnd = time.monotonic(), coord.open
        number = rnd.number if rnd is not None else 0
        if not force and mono - self._synced_at < self.min_interval_s and number == self._open_number:
            return  # a round that opened is synced at once
        self._synced_at, self._open_number = mono, number
        self.counters(coord.counters)
        self.queue.set(coord.events.bytes)
        now = coord.clock()
        self.open_round.set(number)
        if rnd is not None:
            bound = rnd.ctx.bounds.norm_bound
            self.norm_bound.set(math.inf if bound is None else float(bound))
        registry = coord.registry

        def raw(ids: Iterable[str]) -> list[str]:
            return [device_label(d.info if (d := registry.get(c)) else None) for c in ids]

        online = raw(coord.online(now))
        kept = self._choose_labels(online)

        def labels(values: Iterable[str]) -> TallyCounter[str]:
            return TallyCounter(v if v in kept or v == NO_LABEL else OTHER_LABEL for v in values)

        counts = [labels(online), labels(raw(rnd.selected if rnd is not None else ())),
                  labels(raw(rnd.accepted if rnd is not None else ()))]
        exported = {*kept, NO_LABEL, *(k for c in counts for k in c)}
        for gauge, c in zip((self.online, self.selected, self.reporting), counts):
            self._set(gauge, c, exported)
        self._labels = exported
        self.devices_privacy(registry.infos())

    def devices_privacy(self, infos: Iterable[Mapping[str, Any]]) -> None:
        """The devices' own ledgers from their last statuses (rule 5); nothing while none reports one."""
        dp = device_privacy(infos)
        if dp is not None:
            self.privacy.devices(dp)

    def counters(self, counters: Mapping[str, int]) -> None:
        """The coordinator's cumulative counters (rule 1); a name outside :data:`REFUSAL_REASONS` and
        :data:`NOT_REFUSALS` is logged once and not exported (a new counter must be added to the set)."""
        for name, value in counters.items():
            delta = int(value) - self._counted.get(name, 0)
            if delta == 0:
                continue
            if name in REFUSAL_REASONS:
                metric = self.refused.labels(name)
            elif name == "clipped":
                metric = self.clipped
            else:
                if name not in self._counted:
                    log.warning("counter %r is not among the exported refusal reasons; not exported", name)
                self._counted[name] = int(value)
                continue
            if delta > 0:
                metric.inc(delta)
            self._counted[name] = int(value)

    @staticmethod
    def _choose_labels(online: list[str]) -> set[str]:
        """The labels kept (rule 4): the :data:`MAX_LABELS` carried by the most online devices, ties by name."""
        tally = TallyCounter(v for v in online if v not in (NO_LABEL, OTHER_LABEL))
        ranked = sorted(tally, key=lambda v: (-tally[v], v))
        return set(ranked[:MAX_LABELS])

    def _set(self, gauge: Gauge, counts: Mapping[str, int], exported: set[str]) -> None:
        for label in exported:
            gauge.labels(label).set(counts.get(label, 0))
        for label in self._labels - exported:  # no online device carries it any more: the series goes
            try:
                gauge.remove(label)
            except KeyError:
                pass


class MetricsServer(BoundedHTTPServer):
    """``GET /metrics``: the registry in Prometheus' text format; the access rule of :mod:`transport.access`
    (loopback: open; elsewhere a token, ``Authorization: Bearer``; a ``Host`` that is neither an address nor a name
    of this machine: 421). It reads nothing but the registry."""

    daemon_threads = True

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.registry, self.token = registry, token_for(host, token)
        self.names = served_names(host)  # the Host headers it answers (transport.access, rule 4)
        self.request_timeout_s = request_timeout_s  # an idle or stalled connection is closed after this long
        self.scraped = threading.Condition()
        self.scrapes = 0
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="metrics", daemon=True)
        t.start()
        return t

    def wait_scrape(self, after: int, timeout: float) -> bool:
        """Until a scrape after the first ``after`` ones was answered, at most ``timeout`` seconds."""
        with self.scraped:
            return self.scraped.wait_for(lambda: self.scrapes > after, timeout)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BoundedHandler):
    server: MetricsServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout_s)  # an idle connection frees its thread

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if not host_allows(self.headers, self.server.names):
            self._send(HTTPStatus.MISDIRECTED_REQUEST, b"421: scrape this endpoint by an address or a name of its "
                                                       b"machine\n")
            return
        if not token_allows(self.server.token, self.path, self.headers)[0]:
            self._send(HTTPStatus.UNAUTHORIZED, b"401: a valid token is required (Authorization: Bearer ...)\n")
            return
        if urlsplit(self.path).path != "/metrics":
            self._send(HTTPStatus.NOT_FOUND, b"404: the metrics are at /metrics\n")
            return
        self._send(HTTPStatus.OK, generate_latest(self.server.registry), CONTENT_TYPE)
        with self.server.scraped:
            self.server.scrapes += 1
            self.server.scraped.notify_all()

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"405: the metrics endpoint is read-only\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method


def read_token(token_file: Path | None, host: str, state_dir: Path) -> str | None:
    """The token the endpoint on ``host`` requires (:func:`transport.access.token_for`): the first line of
    ``token_file`` when given; off loopback without one, the token saved in ``state_dir/metrics.token``
    (0600), generated at the first start and kept, so a scraper's ``credentials_file`` stays valid across
    restarts. ValueError (naming the file) for an unreadable or short token."""
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"metrics_token_file {token_file}: {exc.strerror or exc}") from None
        given = lines[0].strip() if lines else ""
        try:
            return token_for(host, given)
        except ValueError as exc:
            raise ValueError(f"metrics_token_file {token_file}: {exc}") from None
    if is_loopback(host):
        return None
    saved = state_dir / TOKEN_FILE
    if saved.exists():
        return read_token(saved, host, state_dir)
    token = token_for(host, None)
    assert token is not None
    private_dir(state_dir, "state_dir")
    fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    log.warning("metrics endpoint on %s needs a token: generated into %s (give it to the scraper as its "
                "credentials_file)", host, saved)
    return token
