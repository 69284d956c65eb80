"""A local user who drips bytes into the coordinator's HTTP endpoints (docs/howto/service.md; the exporter and the
dashboard run inside the coordinator and the dashboard processes).

The adversary can reach the exporter's port (loopback by default: any local user) and holds a few hundred
connections open, each sending one byte of a request every second so that no socket timeout fires. Before the
defence each held a thread and a descriptor for as long as it kept dripping, and with 300 of them the coordinator
process ran out of open files (its journal could no longer be opened). The guarantee: the endpoint holds at most
its cap of connections -- more are closed as they are accepted -- and a request whose line and headers are not in
within the deadline is cut, however slowly it trickles.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from coordinator.exporter import MetricsServer
from coordinator.http_bounds import MAX_CONNECTIONS

pytestmark = pytest.mark.slow  # about 15 s

HELD = MAX_CONNECTIONS + 40


def test_dripping_connections_are_capped_and_cut() -> None:
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    server.request_deadline_s = 1.5  # the test's scale: 20 s as shipped
    server.serve_in_thread()
    socks = []
    try:
        for _ in range(HELD):
            s = socket.create_connection(server.server_address[:2], timeout=5)
            s.sendall(b"G")
            socks.append(s)
        time.sleep(1.0)
        held = sum("process_request_thread" in t.name for t in threading.enumerate())  # one a connection held
        assert held <= MAX_CONNECTIONS, f"{held} connections held for {HELD} dripping clients"
        deadline = time.monotonic() + 6.0
        open_ = list(socks)
        while open_ and time.monotonic() < deadline:  # keep dripping: one byte a second on every connection
            still = []
            for s in open_:
                try:
                    s.sendall(b"E")
                    s.settimeout(0.01)
                    if s.recv(1024) == b"":
                        continue  # closed by the server
                except (BlockingIOError, socket.timeout):
                    pass
                except OSError:
                    continue
                still.append(s)
            open_ = still
            time.sleep(1.0)
        assert not open_, f"{len(open_)} dripping connections still open after the request deadline"
        with socket.create_connection(server.server_address[:2], timeout=5) as s:  # an honest scrape gets in again
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.0 200")
    finally:
        for s in socks:
            s.close()
        server.close()
