"""A stranger's idle TCP connections against the broker (docs/explanation/guarantees.md, "A stranger's
connections"; docs/explanation/broker.md, "Connections and open files").

The adversary is a stranger on the network: no credentials, it only opens TCP connections to the broker's ports and
sends nothing (no CONNECT). Mosquitto holds one descriptor per connection, so on a host whose default soft
open-file limit is 1,024 about 1,020 such sockets once left no descriptor for anyone: every device and the
coordinator were refused. The test scales the host down by eight (soft limit 128, hard 8,192) and starts the broker
as the operator does, with ``flayer broker start`` (a real Mosquitto from the configuration the CLI writes).
The guarantees:

- more idle sockets than the host's soft limit (200) do not lock a device out: the broker may open every listener's
  ``max_connections`` plus its own descriptors (the launcher raises the limit it inherits, or refuses to start);
- a stranger who fills the device listener (TLS) to its ``max_connections`` and past it takes no descriptor the
  broker needs: the coordinator on the loopback listener still connects, and a broker whose limits do not fit the
  host's hard limit is refused at start with a message naming both.

What is not held (stated on the guarantees page): while the stranger holds a listener's ``max_connections``
sockets, devices on that listener are refused (Mosquitto has no per-address limit).
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mqtt_broker import mosquitto_available
from mqtt_broker.state import load_credentials
from tests.mqtt_broker.broker_testlib import try_connect
from transport.credentials import mqtt_connect_settings

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
ROOT = Path(__file__).resolve().parents[2]


def _flayer(*argv: str, nofile: tuple[int, int] | None = None) -> subprocess.CompletedProcess[str]:
    """``flayer ARGV`` as its own process; ``nofile``: the (soft, hard) open-file limit of the host it runs on."""
    def limits() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    return subprocess.run([sys.executable, "-P", "-m", "cli.main", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=limits, check=False)


@contextlib.contextmanager
def _broker(state: Path, *flags: str, nofile: tuple[int, int]) -> Iterator[subprocess.CompletedProcess[str]]:
    started = _flayer("broker", "start", "--state-dir", str(state), "--port", "0", "--no-persistence", *flags,
                      nofile=nofile)
    try:
        yield started
    finally:
        if started.returncode == 0:
            _flayer("broker", "stop", "--state-dir", str(state))


@contextlib.contextmanager
def _stranger(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` idle TCP connections to ``port`` (as many as the broker lets through), no CONNECT sent."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        yield socks
    finally:
        for s in socks:
            s.close()


def test_more_idle_sockets_than_the_hosts_soft_limit_lock_no_device_out(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    with _broker(state, nofile=(128, 8192)) as started:
        assert started.returncode == 0, started.stderr
        assert _flayer("broker", "add-device", "dev-a", "--state-dir", str(state)).returncode == 0
        dev = mqtt_connect_settings(load_credentials(state, "dev-a"))
        with _stranger(dev.port, 200) as socks:
            assert len(socks) == 200
            rc, client = try_connect(dev, timeout=5)
            client.disconnect()
            client.loop_stop()
        assert rc == 0, f"with a stranger's 200 idle sockets open the device got CONNACK {rc}"


def test_a_stranger_who_fills_the_device_listener_takes_no_descriptor_the_broker_needs(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    with _broker(state, "--tls", "--tls-port", "0", "--max-connections", "100", nofile=(128, 128)) as refused:
        assert refused.returncode == 2 and "needs 264 open files" in refused.stderr and "hard limit 128" in \
            refused.stderr, refused.stderr  # two listeners of 100 and its own 64 do not fit: refused, not started
    with _broker(state, "--tls", "--tls-port", "0", "--max-connections", "100", nofile=(128, 512)) as started:
        assert started.returncode == 0, started.stderr
        coord = mqtt_connect_settings(load_credentials(state, "coordinator"), use_tls=False)  # the loopback listener
        tls_port = load_credentials(state, "coordinator").tls.port  # type: ignore[union-attr]
        with _stranger(tls_port, 300) as socks:
            assert len(socks) >= 100
            rc, client = try_connect(coord, timeout=5)
            client.disconnect()
            client.loop_stop()
        assert rc == 0, f"with the device listener flooded the coordinator got CONNACK {rc}"
