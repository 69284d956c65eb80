"""A device's model token opens the model files and nothing beside them (docs/howto/http-models.md, "Who may
fetch").

The adversary is an enrolled device: it holds its own HTTP token (derived from its broker password) and asks
nginx for paths outside the models folder -- the broker's state folder next to it (the coordinator's
credentials, every device's), encoded every way a path can climb -- and for the coordinator's temporary files
(dotfiles) in it. Every answer must be a refusal without a byte of those files. A real nginx.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

import pytest

from coordinator.model_server import NginxServer, find_nginx
from mqtt_broker import BrokerConfig, add_device, load_credentials
from mqtt_broker.state import write_broker_files
from protocol import blob_digest
from transport.models_auth import authorization

pytestmark = pytest.mark.skipif(find_nginx() is None, reason="nginx is not installed (make apt-http)")


def _raw_get(server: NginxServer, target: str, auth: str) -> tuple[int, bytes]:
    """GET ``target`` as written (no client-side normalisation of the path)."""
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture
def served(tmp_path: Path) -> Any:
    state = tmp_path / "broker"
    files = write_broker_files(BrokerConfig(federation="httpfed", persistence=False), state)
    add_device(state, "dev-1")
    blob = hashlib.shake_256(b"global model").digest(4_000)
    server = NginxServer(tmp_path / "models", tmp_path / "nginx", htpasswd=files.models_htpasswd).start()
    (server.root / blob_digest(blob)).write_bytes(blob)
    (server.root / f".{blob_digest(blob)}.tmp").write_bytes(b"half a model")
    try:
        yield server, state, blob
    finally:
        server.stop()


def test_a_devices_token_opens_nothing_beside_the_model_files(served: Any) -> None:
    server, state, blob = served
    dev = load_credentials(state, "dev-1")
    auth = authorization(dev.username, dev.password)
    assert _raw_get(server, f"/{blob_digest(blob)}", auth) == (200, blob)  # positive control
    secret = (state / "credentials/coordinator.toml").read_text()
    assert "password" in secret
    targets = ["/../broker/credentials/coordinator.toml", "/%2e%2e/broker/credentials/coordinator.toml",
               "/..%2fbroker%2fcredentials%2fcoordinator.toml", "/%2e%2e%2fbroker/credentials/coordinator.toml",
               "/models/../../broker/credentials/coordinator.toml", "//../broker/credentials/coordinator.toml",
               "/..\\broker\\credentials\\coordinator.toml", f"/.{blob_digest(blob)}.tmp",
               f"/%2e{blob_digest(blob)}.tmp"]
    coord = load_credentials(state, "coordinator")
    for target in targets:
        status, body = _raw_get(server, target, auth)
        assert status in (400, 403, 404), f"{target}: HTTP {status}"
        assert coord.password.encode() not in body and b"half a model" not in body, f"{target} leaked a file"
