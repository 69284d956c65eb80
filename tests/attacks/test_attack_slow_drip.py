"""Slow-drip HTTP (docs/explanation/guarantees.md, "Bounds on a hostile peer").

Two adversaries, each with only a TCP socket:

- the server a device fetches its model from (whoever answers at the plan's ``models_url``, or sits on the
  path to it) drips the body one byte at a time, never silent for long enough to trip the per-read
  timeout, to keep the device downloading for ever. The guarantee holds when the device gives up at its
  overall deadline, says why (``http_fallback``, failure ``deadline``), and finishes the model from the
  broker's retained chunks;
- a client of the coordinator host's HTTP endpoints (the Prometheus exporter, the dashboard) opens
  connections and sends nothing, each one holding a server thread. The guarantee holds when the server
  closes such a connection once its request timeout has passed.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from coordinator.dashboard.server import DashboardServer
from coordinator.dashboard.watch import FleetWatch
from coordinator.exporter import MetricsServer
from edge_client.fetch import HttpDone
from protocol import Kind, Plan, Topics, blob_digest, chunk_blob
from tests.http_models.fetchlib import COORD_KEY, FetchDevice


class DripServer:
    """Answers every request with a 200 and a ``Content-Length`` of the whole file, then one byte of it
    every ``every_s`` seconds (the adversary's server)."""

    def __init__(self, body: bytes, every_s: float) -> None:
        self.body, self.every_s = body, every_s
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sent = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)  # the request
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: application/octet-stream\r\n\r\n"
                         % len(self.body))
            for b in self.body:
                if self.stop.wait(self.every_s):
                    return
                try:
                    conn.sendall(bytes([b]))
                except OSError:
                    return
                self.sent += 1

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def raw_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_client.fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "decode_global", lambda blob, strategy, limits: {"blob": blob})


def test_a_slow_drip_model_server_is_given_up_and_the_brokers_chunks_finish_the_model(tmp_path: Path,
                                                                                       raw_model: None) -> None:
    blob = hashlib.shake_256(b"drip").digest(20_000)
    digest = blob_digest(blob)
    drip = DripServer(blob, every_s=0.1)  # never silent for the 1 s read timeout
    try:
        chunks = chunk_blob(blob, Kind.MODEL_CHUNK, "fed", "coordinator", 1, 8192, key=COORD_KEY)
        plan = Plan(1, ("dev",), 0.0, "fedavg", {}, {"name": "cnn"}, digest, len(chunks), len(blob),
                    models_url=f"http://127.0.0.1:{drip.port}/")
        dev = FetchDevice(tmp_path, http_timeout_s=1.0, http_deadline_s=2.0)
        dev.plan = plan
        started = time.monotonic()
        dev._fetch(plan)
        assert dev._http is not None
        try:
            done = dev.events.get(timeout=10)  # the deadline is 2 s: 10 s means it never gave up
        except Exception:  # noqa: BLE001 -- queue.Empty, said plainly
            pytest.fail(f"the device was still downloading after 10 s ({drip.sent} bytes dripped)")
        took = time.monotonic() - started
        assert isinstance(done, HttpDone) and done.error is not None and done.error.kind == "deadline", done
        assert took < 5.0 and 0 < drip.sent < len(blob)
        dev._on_http_done(done)
        assert dev.progress[0][0] == "http_fallback" and dev.progress[0][1]["failure"] == "deadline"
        assert dev.link.subscribed == [Topics("fed").model_filter(digest)]  # the broker's chunks instead
        for payload in chunks:
            dev._on_model_chunk(digest, payload)
        assert dev._model == (digest, {"blob": blob})
    finally:
        drip.close()


def _closed_within(port: int, seconds: float) -> bool:
    """Connect, send nothing: whether the server closes the connection within ``seconds``."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as s:
        try:
            return s.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


@pytest.mark.parametrize("endpoint", ["exporter", "dashboard"])
def test_idle_connections_to_the_coordinators_http_endpoints_are_closed(tmp_path: Path, endpoint: str) -> None:
    server: Any
    watch = None
    if endpoint == "exporter":
        server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, request_timeout_s=1.0)
    else:
        watch = FleetWatch(None, tmp_path / "metrics.jsonl").start()
        server = DashboardServer(watch, "127.0.0.1", 0, request_timeout_s=1.0)
    server.serve_in_thread()
    try:
        port = int(server.server_address[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # idle ones, held open
        assert _closed_within(port, 4.0), f"the {endpoint} kept an idle connection open past its 1 s timeout"
        for s in held:
            s.settimeout(2.0)
            assert s.recv(1) == b""
            s.close()
    finally:
        server.close()
        if watch is not None:
            watch.stop()
