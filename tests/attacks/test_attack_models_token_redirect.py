"""A plan that redirects a device's models token (docs/explanation/guarantees.md, "Model files over HTTP";
docs/howto/http-models.md, "Who may fetch"; the design's move 3: a token sent to a host the message names).

The adversary holds the coordinator's signing key (the coordinator, or whoever took its host): its signed plan names
``models_url = http://127.0.0.2:PORT``, a server it runs that records every request. A device that followed it
would hand over its models token (HTTP basic authentication), which opens the federation's model server as that
device. The device is a real edge client on a real Mosquitto; its credentials name the broker at 127.0.0.1. The
guarantee: the recording server receives no token -- no request at all -- and the device takes the model from the
broker instead. The control: the same plan naming the broker's own host gets the token (so the attack is real).
"""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import FedBroker

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from mqtt_broker import mosquitto_available
from protocol import Plan, Topics, encode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"


class _Recording(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str) -> None:
        self.seen: list[tuple[str, str]] = []  # (path, Authorization)
        super().__init__((host, 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Recording

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Authorization", "")))
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _plan(round_: int, url: str) -> Plan:
    return Plan(round_, ("dev-a",), time.time() + 600, "fedavg", {}, {"name": "mlp"}, f"{round_:02d}" * 32, 1, 100,
                models_url=url)


def _requests_after_plan(fed: FedBroker, shard: Any, tmp_path: Path, host: str, round_: int) -> list[tuple[str, str]]:
    server = _Recording(host)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    coord = fed.listen()
    client = EdgeClient(EdgeSettings(state_dir=str(tmp_path / f"dev-a-{round_}"), device="cpu", heartbeat_s=2.0),
                        fed.devices["dev-a"], shard)
    client.start()
    try:
        url = f"http://{host}:{server.server_address[1]}/models"
        plan = encode_message(_plan(round_, url), FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(Topics(FED).round(), plan, retain=True)], 5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not server.seen and client._download is None:
            time.sleep(0.05)  # the device either asks the URL or subscribes to the broker's chunks
        time.sleep(0.5)
        assert client.plan is not None and client.plan.round == round_, "the device did not take the plan"
        return list(server.seen)
    finally:
        client.stop()
        coord.close()
        server.shutdown()
        server.server_close()


def test_a_plan_naming_another_host_gets_no_models_token(tmp_path: Path, attack_fed: Any,
                                                         digits_shard: Any) -> None:
    fed = attack_fed(["dev-a"], view="coordinator", federation=FED)
    shard = digits_shard(0)
    seen = _requests_after_plan(fed, shard, tmp_path, "127.0.0.2", 1)
    assert seen == [], f"the device sent {len(seen)} request(s) to the host the plan named: {seen[:2]}"
    # the control: the broker's own host (named by the device's credentials) is sent the token
    seen = _requests_after_plan(fed, shard, tmp_path, "127.0.0.1", 2)
    assert seen and seen[0][1].startswith("Basic "), seen
