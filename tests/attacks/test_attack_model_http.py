"""Model files over HTTP for the federation's devices and coordinator only (docs/explanation/guarantees.md,
"Model files over HTTP"; docs/howto/http-models.md, "Who may fetch").

The adversaries know a model's digest (it is in every round plan, which observers read, and it is the file
name) and can reach nginx's port: a stranger with no credentials, a stranger who makes up a user name and
a token, an observer of the federation with its own broker credentials (it may read plans and statuses,
no model) who presents them as a device would and also its raw broker password, and a device revoked
since it got its kit. Each asks for the global model by its digest. The guarantee holds when every one of
them gets 401 and no byte of the file, while an enrolled device (and the coordinator) fetch it, all from
the same real nginx serving the broker state folder's ``models.htpasswd``.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
from pathlib import Path
from typing import Any

import pytest

from coordinator.model_server import NginxServer, find_nginx
from edge_client.http_fetch import HttpFetchError, HttpTarget, fetch_blob
from mqtt_broker import BrokerConfig, add_device, add_observer, load_credentials
from mqtt_broker.kit import revoke_device
from mqtt_broker.state import BrokerFiles, write_broker_files
from protocol import blob_digest
from transport.models_auth import authorization

pytestmark = pytest.mark.skipif(find_nginx() is None, reason="nginx is not installed (make apt-http)")


def _get(server: NginxServer, digest: str, auth: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", f"/{digest}", headers={} if auth is None else {"Authorization": auth})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _basic(user: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()


@pytest.fixture
def served(tmp_path: Path) -> Any:
    state = tmp_path / "broker"
    files = write_broker_files(BrokerConfig(federation="httpfed", persistence=False), state)
    for d in ("dev-1", "dev-2"):
        add_device(state, d)
    add_observer(state, "watch-2")
    blob = hashlib.shake_256(b"global model").digest(40_000)
    digest = blob_digest(blob)
    server = NginxServer(tmp_path / "models", tmp_path / "nginx", htpasswd=files.models_htpasswd).start()
    (server.root / digest).write_bytes(blob)
    try:
        yield server, state, blob, digest
    finally:
        server.stop()


def test_strangers_observers_and_revoked_devices_are_refused_the_model_files(served: Any, tmp_path: Path) -> None:
    server, state, blob, digest = served
    observer = load_credentials(state, "observer")
    watcher = load_credentials(state, "watch-2")
    dev2 = load_credentials(state, "dev-2")
    # positive controls first: an enrolled device fetches the model, as the device's own code does
    dev = load_credentials(state, "dev-1")
    got, _ = fetch_blob(HttpTarget(server.url, digest, len(blob)), tmp_path / "dev-1",
                        authorization=authorization(dev.username, dev.password))
    assert got == blob
    coord = load_credentials(state, "coordinator")
    assert _get(server, digest, authorization(coord.username, coord.password)) == (200, blob)
    assert _get(server, digest, authorization(dev2.username, dev2.password)) == (200, blob)

    attempts = {
        "a stranger, no credentials": None,
        "a stranger with a made-up user and token": _basic("dev-9", "0" * 64),
        "a stranger claiming a device's name": _basic("dev-1", "guess"),
        "the observer, as a device would present its credentials": authorization(observer.username,
                                                                                  observer.password),
        "another observer, the same way": authorization(watcher.username, watcher.password),
        "the observer with its raw broker password": _basic(observer.username, observer.password),
        "a device with its raw broker password": _basic(dev.username, dev.password),
    }
    for who, auth in attempts.items():
        status, body = _get(server, digest, auth)
        assert status == 401 and blob[:64] not in body, f"{who}: HTTP {status}"
    with pytest.raises(HttpFetchError) as refused:  # the device's fetch says why
        fetch_blob(HttpTarget(server.url, digest, len(blob)), tmp_path / "stranger")
    assert refused.value.kind == "http" and "401" in refused.value.reason

    # a device revoked after it got its kit: refused from the next request on, no restart of nginx
    assert revoke_device(state, "dev-2")
    status, body = _get(server, digest, authorization(dev2.username, dev2.password))
    assert status == 401 and blob[:64] not in body
    assert _get(server, digest, authorization(dev.username, dev.password)) == (200, blob)  # the others still fetch
    assert "dev-2:" not in BrokerFiles.at(state).models_htpasswd.read_text()
