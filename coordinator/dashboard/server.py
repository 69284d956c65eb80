"""The dashboard's web server: read-only, standard library only (``http.server``), one page and its assets
from the package, a JSON snapshot and a Server-Sent-Events stream of snapshots.

Routes (GET only; any other method gets 405): ``/`` the page, ``/app.js``, ``/style.css``,
``/api/snapshot`` the fleet now (JSON), ``/events`` a stream of snapshots pushed when the fleet changes
(at most ``MAX_PUSH_HZ`` a second, and at least every ``IDLE_PUSH_S`` so ages and deadlines move).

Access (the rule of :mod:`transport.access`): a request whose ``Host`` is not an address or a name of this
machine (``--allow-host`` adds one) gets 421, so a page of another site cannot read it through DNS rebinding.
Bound to 127.0.0.1 by default. Bound elsewhere it needs a
token (generated when none is given): ``?token=...`` on the first request, or ``Authorization: Bearer
...``; a correct token sets an HttpOnly, SameSite=Strict cookie so the page's own requests carry it. A missing or wrong token gets
401 and no data. A connection idle for ``REQUEST_TIMEOUT_S`` (no request, or a stream nobody reads) is
closed. Nothing the server does can change the federation: its only inputs are GET requests,
and its broker credentials are the observer's, which the ACL lets publish nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from coordinator.http_bounds import BoundedHandler, BoundedHTTPServer
from transport.access import REQUEST_TIMEOUT_S, host_allows, served_names, token_allows, token_for
from transport.hosts import is_loopback

from .watch import FleetWatch

__all__ = ["DashboardServer", "is_loopback"]

log = logging.getLogger(__name__)

MAX_PUSH_HZ = 4.0
IDLE_PUSH_S = 2.0
MAX_STREAMS = 32
COOKIE = "flayer_dashboard"
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}
HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store",
           "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                      "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"}


def _asset(name: str) -> bytes:
    return resources.files("coordinator.dashboard").joinpath("static").joinpath(name).read_bytes()


class DashboardServer(BoundedHTTPServer):
    daemon_threads = True

    def __init__(self, watch: FleetWatch, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, allow_hosts: tuple[str, ...] = ()) -> None:
        self.watch, self.token = watch, token_for(host, token)  # transport.access: the rule, written once
        self.names = served_names(host, allow_hosts)  # the Host headers it answers (transport.access, rule 4)
        self.request_timeout_s = request_timeout_s  # an idle or stalled connection is closed after this long
        self.streams = threading.BoundedSemaphore(MAX_STREAMS)
        self.closing = threading.Event()
        self.assets = {path: (_asset(name), ctype) for path, (name, ctype) in ASSETS.items()}
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/" + (f"?token={self.token}" if self.token else "")

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="dashboard",
                             daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class _Handler(BoundedHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout_s)  # an idle keep-alive or stalled reader: freed

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # ---- access ---------------------------------------------------------------------------------------
    def _allowed(self) -> tuple[bool, bool]:
        """(allowed, set the cookie): :func:`transport.access.token_allows`."""
        return token_allows(self.server.token, self.path, self.headers, COOKIE)

    # ---- responses ------------------------------------------------------------------------------------
    def _head(self, status: int, ctype: str, length: int | None, cookie: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if length is not None:
            self.send_header("Content-Length", str(length))
        for k, v in HEADERS.items():
            self.send_header(k, v)
        if cookie:
            self.send_header("Set-Cookie", f"{COOKIE}={self.server.token}; HttpOnly; SameSite=Strict; Path=/")
        self.end_headers()

    def _send(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8", cookie: bool = False) -> None:
        self._head(status, ctype, len(body), cookie)
        self.wfile.write(body)

    def do_GET(self) -> None:
        if not host_allows(self.headers, self.server.names):
            self._send(HTTPStatus.MISDIRECTED_REQUEST, b"421: this dashboard answers to its own address and names "
                                                       b"only (--allow-host NAME for another)\n")
            return
        ok, cookie = self._allowed()
        if not ok:
            self._send(HTTPStatus.UNAUTHORIZED, b"401: a valid token is required (?token=...)\n")
            return
        path = urlsplit(self.path).path
        if path in self.server.assets:
            body, ctype = self.server.assets[path]
            self._send(HTTPStatus.OK, body, ctype, cookie)
        elif path == "/api/snapshot":
            self._send(HTTPStatus.OK, json.dumps(self.server.watch.snapshot()).encode(), "application/json", cookie)
        elif path == "/events":
            self._stream(cookie)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"404: not found\n")

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"405: the dashboard is read-only\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method

    def _stream(self, cookie: bool) -> None:
        if not self.server.streams.acquire(blocking=False):
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"503: too many open dashboards\n")
            return
        try:
            self.close_connection = True
            self._head(HTTPStatus.OK, "text/event-stream", None, cookie)
            watch, version = self.server.watch, -1
            while not self.server.closing.is_set():
                snap = watch.snapshot()
                version = snap["version"]
                self.wfile.write(b"data: " + json.dumps(snap).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(1.0 / MAX_PUSH_HZ)
                watch.wait_change(version, IDLE_PUSH_S)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the page went away
        finally:
            self.server.streams.release()
