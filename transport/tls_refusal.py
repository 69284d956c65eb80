"""Telling a broker that refuses this client's TLS certificate from one that is down.

A broker whose revocation list names the client's certificate (``flayer broker revoke``, ``add-device --rotate``),
or that no longer trusts it (expired, another CA), ends the TLS handshake with a certificate alert. paho only sees a
lost connection and reconnects forever, as it must for a broker that is restarting or a network that dropped. So
the client's TLS sockets (:class:`WatchedContext`, made by ``transport.credentials.tls_context``) note every
certificate alert the broker sends, and :class:`CertRefusals` decides when to give up:

- an alert that comes **after the handshake completed** (TLS 1.3, where the broker checks the client's certificate
  once the client has finished) is the broker's own: it travels encrypted under the session's keys, agreed with a
  broker whose certificate the federation CA signed, so nobody on the path can forge it. ``AUTHENTICATED`` (3)
  such refusals in a row, spread over at least 3 s (paho's backoff: attempts 0, 1 and 3 s apart), give up;
- an alert **during the handshake** (TLS 1.2, where it is sent before any key is agreed) could be forged by whoever
  sits on the path, so these give up only after ``IN_CLEAR`` (5) in a row over at least 60 s;
- anything else -- a connection refused or reset, a handshake cut short, a timeout, a broker restarting --
  is no certificate alert: it starts the count again, and the client keeps retrying with backoff. So does a
  connection the broker accepted.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTHENTICATED", "CERT_ALERTS", "IN_CLEAR", "CertAlert", "CertRefusals", "RefusalWatch", "WatchedContext",
           "refusal_watch"]

AUTHENTICATED = (3, 3.0)  # (refusals in a row, least seconds from the first to the last) for alerts after the handshake
IN_CLEAR = (5, 60.0)  # the same for alerts during the handshake (forgeable on the path)

# OpenSSL's reason for each alert a TLS server sends about the client's certificate -> what it means
CERT_ALERTS = {
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "certificate revoked",
    "SSLV3_ALERT_BAD_CERTIFICATE": "bad certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "certificate expired",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "certificate unknown",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "unsupported certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "certificate of an unknown CA",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "certificate required",
}


@dataclass(frozen=True)
class CertAlert:
    what: str  # a value of CERT_ALERTS
    authenticated: bool  # after the handshake completed: sent under the session's keys


class RefusalWatch:
    """The last certificate alert a broker sent on the connections of one TLS context (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._alert: CertAlert | None = None

    def note(self, alert: CertAlert) -> None:
        with self._lock:
            self._alert = alert

    def take(self) -> CertAlert | None:
        """The alert noted since the last call, if any (and forget it)."""
        with self._lock:
            alert, self._alert = self._alert, None
            return alert


class _WatchedSocket(ssl.SSLSocket):
    """An SSLSocket that notes the certificate alerts it reads into its context's :class:`RefusalWatch`."""

    _handshaken = False

    def _noted(self, exc: ssl.SSLError) -> None:
        what = CERT_ALERTS.get(str(getattr(exc, "reason", "") or ""))
        watch = refusal_watch(self.context)
        if what is not None and watch is not None:
            watch.note(CertAlert(what, self._handshaken))

    def do_handshake(self, block: bool = False) -> None:
        try:
            super().do_handshake(block)
        except ssl.SSLError as exc:
            self._noted(exc)
            raise
        self._handshaken = True

    def read(self, len: int = 1024, buffer: Any = None) -> Any:  # ssl.SSLSocket's own parameter names
        try:
            return super().read(len, buffer)
        except ssl.SSLError as exc:
            self._noted(exc)
            raise

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except ssl.SSLError as exc:
            self._noted(exc)
            raise


class WatchedContext(ssl.SSLContext):
    """A client SSLContext whose sockets note the broker's certificate alerts in ``self.refusals``."""

    sslsocket_class = _WatchedSocket

    def __init__(self, protocol: int = ssl.PROTOCOL_TLS_CLIENT) -> None:
        self.refusals = RefusalWatch()


def refusal_watch(ctx: Any) -> RefusalWatch | None:
    """The watch of ``ctx`` (a :class:`WatchedContext`), else None."""
    watch = getattr(ctx, "refusals", None) if isinstance(ctx, WatchedContext) else None
    return watch if isinstance(watch, RefusalWatch) else None


class CertRefusals:
    """Counts failed connection attempts in a row that ended with a certificate alert (module docstring)."""

    def __init__(self, authenticated: tuple[int, float] = AUTHENTICATED, in_clear: tuple[int, float] = IN_CLEAR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.authenticated, self.in_clear, self.clock = authenticated, in_clear, clock
        self._first = 0.0
        self._count = 0  # refusals in a row, either kind
        self._signed = 0  # of which after the handshake

    def connected(self) -> None:
        """The broker accepted a connection: start again."""
        self._count = self._signed = 0

    def failed(self, alert: CertAlert | None) -> str | None:
        """One attempt failed, with ``alert`` (None: no certificate alert, e.g. the broker is down). Returns why
        to give up once the refusals in a row are enough, else None."""
        if alert is None:
            self.connected()
            return None
        now = self.clock()
        if self._count == 0:
            self._first = now
        self._count += 1
        self._signed = self._signed + 1 if alert.authenticated else 0
        span = now - self._first
        if self._signed >= self.authenticated[0] and span >= self.authenticated[1]:
            return f"{alert.what}; {self._count} handshakes refused in a row over {span:.0f} s"
        if self._count >= self.in_clear[0] and span >= self.in_clear[1]:
            return f"{alert.what}, during the handshake; {self._count} handshakes refused in a row over {span:.0f} s"
        return None
