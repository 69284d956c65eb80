"""What one stranger may hold of the coordinator host's HTTP endpoints (the Prometheus exporter, the dashboard):
at most :data:`MAX_CONNECTIONS` connections at once -- one past it is closed as it is accepted -- and the time to
send a request's line and headers, :data:`REQUEST_DEADLINE_S` from the connection's start whatever trickles in.

A socket timeout alone is reset by every byte: a client sending one byte every few seconds held a connection, and
its thread and descriptor, for ever, and a few hundred such connections used up the open files of the process the
exporter runs in -- the coordinator, whose journal then could not be opened. The dashboard's event streams stay
open once their request is in; their number is bounded by the cap.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MAX_CONNECTIONS", "REQUEST_DEADLINE_S", "BoundedHTTPServer", "BoundedHandler"]

MAX_CONNECTIONS = 64
REQUEST_DEADLINE_S = 20.0


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that holds at most ``max_connections`` connections (module docstring)."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    request_deadline_s = REQUEST_DEADLINE_S

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused_connections = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: this one is closed at once, the others go on
            self.refused_connections += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler whose connection is closed when its request line and headers are not in within the server's
    ``request_deadline_s`` (module docstring)."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(self.server.request_deadline_s, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._deadline.cancel()  # the request is in: what follows is the handler's own business
        return ok

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()
