"""One MQTT connection of the coordinator or an edge client, whose callbacks only enqueue.

paho runs its callbacks on its network thread; anything slow there (decoding, training, disk)
stalls keep-alives and PUBACKs. So :class:`MqttLink` turns every callback into an event
(:class:`Connected`, :class:`Disconnected`, :class:`Received`) handed to ``post`` -- typically
``queue.Queue.put`` -- and the owner's own thread does the work. Publishing is QoS 1 and
:meth:`MqttLink.wait_published` waits for the broker's PUBACKs; a message published while the
link is down stays queued in paho and goes out after the reconnect (paho reconnects by itself,
with ``reconnect_delay_set`` backoff). A TLS broker that refuses the client's certificate, again and again
(:mod:`transport.tls_refusal`: revoked, replaced, expired), ends the retries with ``Connected(ok=False,
certificate=True)`` instead, while a broker that is down is retried for ever. With ``ConnectSettings.failover`` (the other nodes of a clustered
broker), each lost connection or failed connect moves the next attempt to the next address in turn, so a
client whose node died reconnects to another one (docs/howto/clustered-broker.md).

Sizes are the caller's business: check every payload against ``ConnectSettings.max_payload``
before publishing (Mosquitto disconnects a client whose packet is too large, and paho then
re-sends it on every reconnect).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union

from transport.credentials import ConnectSettings, make_client
from transport.tls_refusal import CertAlert, CertRefusals, refusal_watch

__all__ = ["Connected", "Disconnected", "LinkError", "LinkEvent", "MqttLink", "NetworkDriver", "Received", "probe"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connected:
    ok: bool  # False: the broker refused (bad credentials, not authorised, ...)
    session_present: bool
    reason: str
    certificate: bool = False  # (not ok) the TLS handshake refused this client's certificate, again and again


@dataclass(frozen=True)
class Disconnected:
    reason: str


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    retain: bool


LinkEvent = Union[Connected, Disconnected, Received]


class LinkError(RuntimeError):
    """A publish could not be queued, or the link was used after stop()."""


class NetworkDriver(Protocol):
    """Runs the network side of many paho clients instead of one ``loop_start()`` thread each (the
    emulator's shared loop, :class:`emulator.netloop.SharedNetwork`). ``attach`` connects a client
    whose ``connect_async`` was called and keeps it connected; ``detach`` forgets it: after its
    DISCONNECT went out, or at once without one (``abrupt``: the broker publishes the last will)."""

    def attach(self, client: Any) -> None: ...

    def detach(self, client: Any, abrupt: bool = False, timeout: float = 3.0) -> None: ...


def _published(info: Any) -> bool:
    """Whether the broker acknowledged ``info``'s message. paho's ``is_published()`` raises for a
    message published while disconnected (rc NO_CONN) even though paho keeps it queued and sends it
    after the reconnect; its PUBACK still sets the flag read here."""
    with info._condition:
        return bool(info._published)


class MqttLink:
    """A paho client (MQTT 3.1.1) for ``settings``; see module docstring.

    ``clean_session=False`` keeps the broker-side session (subscriptions and queued QoS 1 messages)
    across reconnects; ``will`` = (topic, payload) is published retained by the broker when the link
    dies without a clean disconnect. A callable ``will`` makes a new one for every connection: it is called
    before the first connect and again when a connection is lost, before paho reconnects, so each CONNECT
    carries its own will (a device signs a will per connection: the will of an earlier connection, put back
    later, is told apart, coordinator.registry). ``network``: a :class:`NetworkDriver` that runs this client's
    network side (default: paho's own thread, ``loop_start``). ``cert_refusals``: when the broker's refusals of
    this client's TLS certificate end the retries (:class:`transport.tls_refusal.CertRefusals`).
    """

    def __init__(self, settings: ConnectSettings, post: Callable[[LinkEvent], None], *, clean_session: bool = False,
                 will: tuple[str, bytes] | Callable[[], tuple[str, bytes]] | None = None, keepalive: int = 30,
                 reconnect_delay: tuple[float, float] = (0.5, 30.0), network: NetworkDriver | None = None,
                 cert_refusals: CertRefusals | None = None) -> None:
        self.settings = settings
        self._post = post
        self._keepalive = keepalive
        self._network = network
        self._stopped = False
        self.connected = threading.Event()
        self.addresses = [(settings.host, settings.port), *settings.failover]
        self._address = 0  # index into addresses of the current (or next) connection attempt
        self._watch = refusal_watch(settings.ssl_context)  # the broker's certificate alerts (TLS only)
        self._refusals = cert_refusals or CertRefusals()
        self.refused: str | None = None  # why the broker's certificate refusals ended the retries
        self.client = make_client(settings, clean_session=clean_session)
        self.client.max_queued_messages_set(0)
        self.client.reconnect_delay_set(int(max(1, reconnect_delay[0])), int(max(1, reconnect_delay[1])))
        self._will = will if callable(will) else None
        if will is not None:
            self._set_will(will() if callable(will) else will)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_connect_fail = self._on_connect_fail

    # ---- paho callbacks: enqueue only ---------------------------------------------------------
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        ok = not reason_code.is_failure
        if ok:
            self.connected.set()
            self._refusals.connected()
        self._post(Connected(ok, bool(getattr(flags, "session_present", False)), str(reason_code)))

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        if len(self.addresses) > 1:
            self._next_address("connect failed")
        self._attempt_failed()

    def _attempt_failed(self) -> CertAlert | None:
        """A connection attempt failed or a connection ended: after enough certificate refusals in a row, stop
        paho's retries and tell the owner (module transport.tls_refusal). Returns the broker's certificate alert."""
        if self._watch is None or self.refused is not None or self._stopped:
            return None
        alert = self._watch.take()
        why = self._refusals.failed(alert)
        if why is None:
            return alert
        self.refused = why
        log.info("%s: the broker refused this client's TLS certificate (%s); not retrying",
                  self.settings.client_id, why)
        self.client.disconnect()  # no more attempts where paho can tell (the owner still calls stop())
        self._post(Connected(False, False, why, certificate=True))
        return alert

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self.connected.clear()
        alert = self._attempt_failed()
        if self.refused is not None:
            return
        if len(self.addresses) > 1 and not self._stopped:
            self._next_address(f"disconnected ({reason_code})")
        if self._will is not None and not self._stopped:
            self._set_will(self._will())  # the next connection's own will (paho sends it with the next CONNECT)
        self._post(Disconnected(f"{reason_code}: the broker refused the TLS certificate ({alert.what})" if alert
                                else str(reason_code)))

    def _set_will(self, will: tuple[str, bytes]) -> None:
        self.client.will_set(will[0], will[1], qos=1, retain=True)

    def _next_address(self, why: str) -> None:
        """Point paho's next reconnect at the next address of ``addresses`` (failover)."""
        old = self.addresses[self._address]
        self._address = (self._address + 1) % len(self.addresses)
        host, port = self.addresses[self._address]
        # paho's host/port setters refuse while the state is "connection lost", which is exactly when this
        # runs; reconnect() reads these two attributes (paho 2.x), so the next attempt goes to the new node
        self.client._host, self.client._port = host, port
        log.info("%s: broker %s:%d %s; next attempt on %s:%d", self.settings.client_id, *old, why, host, port)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        self._post(Received(msg.topic, bytes(msg.payload), bool(msg.retain)))

    # ---- owner's thread -------------------------------------------------------------------------
    def start(self) -> None:
        """Connect in the background (paho's network thread); a Connected event follows."""
        self.client.connect_async(self.settings.host, self.settings.port, keepalive=self._keepalive)
        if self._network is not None:
            self._network.attach(self.client)
        else:
            self.client.loop_start()

    def subscribe(self, filters: Iterable[str]) -> None:
        topics = [(f, 1) for f in filters]
        if topics:
            self.client.subscribe(topics)

    def unsubscribe(self, filters: Iterable[str]) -> None:
        topics = list(filters)
        if topics:
            self.client.unsubscribe(topics)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> Any:
        """Queue one QoS 1 message; returns paho's message info (for :meth:`wait_published`)."""
        if self._stopped:
            raise LinkError("link stopped")
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if int(info.rc) not in (-1, 0, 4):  # success, again, or no connection (queued, sent after the reconnect)
            raise LinkError(f"publish to {topic} failed: paho error {int(info.rc)}")
        return info

    def wait_published(self, infos: Sequence[Any], timeout: float,
                       cancelled: Callable[[], bool] = lambda: False) -> bool:
        """True once the broker acknowledged every message of ``infos``; False on timeout or cancel."""
        deadline = time.monotonic() + timeout
        pending = list(infos)
        while pending:
            pending = [i for i in pending if not _published(i)]
            if not pending:
                return True
            if cancelled() or self._stopped or time.monotonic() > deadline:
                return False
            with pending[0]._condition:
                pending[0]._condition.wait(0.05)
        return True

    def publish_all(self, items: Sequence[tuple[str, bytes, bool]], timeout: float,
                    cancelled: Callable[[], bool] = lambda: False,
                    before_each: Callable[[int], None] | None = None) -> bool:
        """Publish (topic, payload, retain) items in order and wait for all their PUBACKs.
        ``before_each(nbytes)`` runs before each publish (e.g. a link shaper's delay)."""
        infos = []
        for topic, payload, retain in items:
            if cancelled():
                return False
            if before_each is not None:
                before_each(len(payload))
            infos.append(self.publish(topic, payload, retain))
        return self.wait_published(infos, timeout, cancelled)

    def stop(self, final: tuple[str, bytes, bool] | None = None, timeout: float = 3.0) -> None:
        """Publish ``final`` (e.g. a retained offline status) if connected, then disconnect cleanly."""
        if self._stopped:
            return
        try:
            if final is not None and self.connected.is_set():
                self.wait_published([self.publish(*final)], timeout)
        except LinkError as exc:
            log.debug("final publish failed: %s", exc)
        self._stopped = True
        self.client.disconnect()
        if self._network is not None:
            self._network.detach(self.client, abrupt=False, timeout=timeout)
        else:
            self.client.loop_stop()

    def abort(self) -> None:
        """Drop the connection without a DISCONNECT, as a power loss or a cut cable would (the
        emulator's crashes): the network side stops, the socket is closed, and the broker publishes
        the last will. Messages not yet sent are lost. The link cannot be used afterwards."""
        if self._stopped:
            return
        self._stopped = True
        self.connected.clear()
        if self._network is not None:
            self._network.detach(self.client, abrupt=True)
            return
        sock = self.client.socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # paho's thread sees the loss and waits >= 1 s to reconnect...
            except OSError:
                pass
        self.client.loop_stop()  # ...while this stops it (it checks at least once a second)


def probe(settings: ConnectSettings, timeout: float = 3.0) -> Connected | None:
    """Connect once with a clean session and no will (so nothing is left behind), and return the
    broker's answer (``Connected``; ``.ok`` False when it refused) or None when none came within
    ``timeout`` seconds."""
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = MqttLink(settings, events.put, clean_session=True)
    link.start()
    try:
        ev: LinkEvent | None = events.get(timeout=timeout)
    except queue.Empty:
        ev = None
    finally:
        link.stop(timeout=1.0)
    return ev if isinstance(ev, Connected) else None
