"""``flayer status`` against a real Mosquitto: a running fleet (devices' retained statuses and the round plan),
a fleet whose devices all went offline after the final plan, and a stopped broker."""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.main import main
from mqtt_broker import BrokerConfig, add_device, load_credentials, mosquitto_available, start_broker
from protocol import Plan, Status, Topics, encode_message
from transport.credentials import mqtt_connect_settings
from transport.link import Connected, MqttLink

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "stest"
ROOT = Path(__file__).resolve().parents[2]
T = Topics(FED)


def _link(creds) -> MqttLink:  # type: ignore[no-untyped-def]
    events: queue.Queue = queue.Queue()
    link = MqttLink(mqtt_connect_settings(creds), events.put, clean_session=True)
    link.start()
    ev = events.get(timeout=10)
    assert isinstance(ev, Connected) and ev.ok, ev
    return link


def _say(link: MqttLink, creds, msg) -> None:  # type: ignore[no-untyped-def]
    topic = T.round() if isinstance(msg, Plan) else T.status(creds.username)
    payload = encode_message(msg, FED, creds.username, key=creds.signer())  # the plan: the coordinator's signature
    link.wait_published([link.publish(topic, payload, retain=True)], 10)


def _plan(r: int, phase: str = "train") -> Plan:
    return Plan(r, ("dev-a", "dev-b"), time.time() + 60, "fedavg", {}, {}, "ab" * 32, 1, 10, phase=phase,
                rounds=3)


def test_status_on_a_running_then_stopped_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "broker"
    broker = start_broker(BrokerConfig(federation=FED, persistence=False), state, kind="mosquitto", timeout=20)
    try:
        devs = {d: add_device(state, d) for d in ("dev-a", "dev-b")}
        broker.reload()
        time.sleep(0.3)  # the reload is asynchronous
        coord = load_credentials(state, "coordinator")
        links = {name: _link(c) for name, c in [("coordinator", coord), *devs.items()]}
        _say(links["coordinator"], coord, _plan(1))
        _say(links["dev-a"], devs["dev-a"], Status(1, "idle", time.time(), {"link_kbps": 1234.5}))
        _say(links["dev-b"], devs["dev-b"], Status(1, "training", time.time(), {}))
        assert main(["status", "--broker-state", str(state)]) == 0
        out = capsys.readouterr().out
        assert "federation stest" in out and "round 1/3 (train): 1/2 selected devices done" in out
        lines = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.strip().startswith("dev-")}
        assert lines["dev-a"][1] == "idle" and "1234" in lines["dev-a"] and lines["dev-b"][1] == "training"
        _watch_redraws(state)
        # the federation ends: the final plan, then every device says goodbye
        _say(links["coordinator"], coord, _plan(4, "final"))
        for d, c in devs.items():
            _say(links[d], c, Status(4, "offline", time.time(), {}))
        assert main(["status", "--broker-state", str(state)]) == 3
        cap = capsys.readouterr()
        assert "no device is online" in cap.err and "2 offline" in cap.out
        for link in links.values():
            link.stop()
    finally:
        broker.stop()
    assert main(["status", "--broker-state", str(state), "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "no broker answers" in err and "the fleet is stopped" in err


def _default_sigint() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A suite started in the background (``make test &``)
    ignores SIGINT, the child would inherit that, and Python installs no KeyboardInterrupt handler then."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _watch_redraws(state: Path) -> None:
    """--watch redraws in place (clear screen, home) until Ctrl-C, which ends it with status 0."""
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "status", "--broker-state", str(state), "--watch",
                             "--interval", "0.2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_default_sigint)
    assert proc.stdout is not None
    out = b""
    try:
        deadline = time.monotonic() + 30
        while out.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                out += os.read(proc.stdout.fileno(), 65536)
    finally:
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=20)[1]
    assert proc.returncode == 0, err
    assert out.count(b"\x1b[H\x1b[2J") >= 3 and out.count(b"dev-a") >= 3, out[-2000:]


def test_status_refuses_device_and_coordinator_credentials(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mqtt_broker import write_broker_files

    files = write_broker_files(BrokerConfig(federation=FED), tmp_path / "broker")
    add_device(files.state_dir, "dev-a")
    for user in ("dev-a", "coordinator"):  # a device may not read; the coordinator's would take its session over
        assert main(["status", "--credentials", str(files.credentials(user))]) == 2
        assert "read-only observer's" in capsys.readouterr().err
