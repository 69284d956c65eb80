"""A device whose TLS certificate the broker refuses stops with a clear error; one facing a broker that is down, or
someone on the path, keeps retrying (docs/howto/devices.md, "Rotate or shut out a device"; docs/explanation/
guarantees.md, TLS; transport/tls_refusal.py).

Against a real Mosquitto with TLS, client certificates and the CA's revocation list: ``flayer broker revoke`` puts
dev-a's certificate on the list, and dev-a, started from the kit it was given (``flayer edge --kit``, its own process),
is refused at every handshake. It must exit 2 within a bounded time, with one line saying its certificate was refused
and what to do. dev-b, whose broker is stopped (connections refused), must still be running well after dev-a would
have given up; a link whose every handshake is cut short (a broker restarting) must not give up either. The adversary
of the last tests sits on the path at the broker's address (it holds no key of the federation): it cuts every
handshake short, or forges a bad-certificate alert in clear at every handshake; neither stops the device within the
3-refusal rule, which only alerts sent under the session's keys meet.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from attacklib import image_folder, until
from fedtestlib import ROOT

from cli.main import main as flayer
from mqtt_broker.kit import write_kit
from transport.credentials import mqtt_connect_settings
from transport.link import Connected, MqttLink
from transport.tls_refusal import AUTHENTICATED, CertAlert, CertRefusals

GIVE_UP_S = 25.0  # process start (imports) + AUTHENTICATED's 3 s of refusals, with room for a loaded machine
STILL_AFTER_S = 8.0  # after its start line, a device facing a down broker still runs (attempts at 0, 1, 3, 7 s)


def _launch(kit: Path, data: Path) -> tuple[subprocess.Popen[bytes], Path]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = kit.with_suffix(".log")
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "cli.main", "edge", "--kit", str(kit), "--data", str(data)],
                                cwd=kit.parent, env=env, stdout=fh, stderr=subprocess.STDOUT)
    return proc, log


@pytest.mark.slow  # two device processes (about 30 s); the link's own tests below are fast
def test_a_revoked_device_exits_with_a_clear_error_and_one_facing_a_down_broker_retries(
        tmp_path: Path, fed_broker: Any) -> None:
    fb = fed_broker(["dev-a", "dev-b"], tls=True)
    data = image_folder(tmp_path / "images", classes=2, per_class=2, side=8)
    kits = {}
    for dev in ("dev-a", "dev-b"):
        (tmp_path / dev).mkdir()
        kits[dev] = write_kit(fb.state_dir, dev, tmp_path / dev / f"{dev}.tar.gz")
    assert flayer(["broker", "revoke", "dev-a", "--state-dir", str(fb.state_dir)]) == 0
    procs = []
    try:
        start = time.monotonic()
        a, a_log = _launch(kits["dev-a"], data)
        procs.append(a)
        exited = until(lambda: a.poll() is not None, GIVE_UP_S)
        took = time.monotonic() - start
        out = a_log.read_text()
        assert exited, f"the revoked device was still retrying after {GIVE_UP_S:.0f} s:\n{out[-2000:]}"
        assert a.returncode == 2, f"exit {a.returncode}:\n{out[-2000:]}"
        said = [line for line in out.splitlines() if "refused this device's TLS certificate" in line]
        # or the broker re-read its users before its revocation list: refused by the MQTT layer, also for good
        unauthorised = [line for line in out.splitlines() if "refused the connection (Not authorized)" in line]
        assert (said and "certificate revoked" in said[-1] and "ask the federation's admin for a new kit" in said[-1]
                or unauthorised), out
        assert "Traceback" not in out, out
        print(f"revoked device exited 2 after {took:.1f} s")

        fb.broker.stop()  # dev-b's broker is down: every connection refused
        b, b_log = _launch(kits["dev-b"], data)
        procs.append(b)
        assert until(lambda: "-> 127.0.0.1" in b_log.read_text() or b.poll() is not None, GIVE_UP_S), b_log.read_text()
        time.sleep(STILL_AFTER_S)
        assert b.poll() is None, f"a device facing a down broker gave up (exit {b.returncode}):\n{b_log.read_text()}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_a_revoked_certificates_link_gives_up_with_the_reason(fed_broker: Any) -> None:
    """The same in one process: the revoked device's link ends its retries with Connected(certificate=True)."""
    import queue

    fb = fed_broker(["dev-a"], tls=True)
    settings = mqtt_connect_settings(fb.devices["dev-a"])
    assert flayer(["broker", "revoke", "dev-a", "--state-dir", str(fb.state_dir)]) == 0
    events: queue.Queue[Any] = queue.Queue()
    link = MqttLink(settings, events.put)
    start = time.monotonic()
    link.start()
    try:
        got = None
        while time.monotonic() - start < 15 and got is None:
            try:
                ev = events.get(timeout=0.2)
            except queue.Empty:
                continue
            got = ev if isinstance(ev, Connected) else None
        assert got is not None, "the revoked certificate's link was still retrying after 15 s"
        assert not got.ok, got
        if got.certificate:  # the broker's TLS layer refused the revoked certificate: counted, then given up
            assert "certificate revoked" in got.reason, got
            assert time.monotonic() - start >= AUTHENTICATED[1] and link.refused == got.reason
        else:  # the broker re-read its users before its revocation list: refused at once by the MQTT layer
            assert got.reason == "Not authorized", got
    finally:
        link.stop(timeout=1)


BAD_CERTIFICATE_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 42])  # a TLS record: fatal alert, in clear


class _CutShort:
    """A listener that accepts each connection, reads the ClientHello and closes: a handshake cut short, as by a
    broker restarting. With ``reply``, it first sends those bytes (a forged alert, as from someone on the path)."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                conn.recv(512)
                conn.sendall(self.reply)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_handshakes_cut_short_keep_a_device_retrying(tmp_path: Path, fed_broker: Any) -> None:
    import dataclasses
    import queue

    fb = fed_broker(["dev-a"], tls=True)
    cut = _CutShort()
    events: queue.Queue[Any] = queue.Queue()
    settings = dataclasses.replace(mqtt_connect_settings(fb.devices["dev-a"]), port=cut.port)
    link = MqttLink(settings, events.put, reconnect_delay=(1, 1))
    link.start()
    try:
        assert until(lambda: cut.accepted >= AUTHENTICATED[0] + 1, 15), f"only {cut.accepted} attempts"
        got = []
        while not events.empty():
            got.append(events.get())
        assert link.refused is None and not any(isinstance(e, Connected) and e.certificate for e in got), got
    finally:
        link.stop(timeout=1)
        cut.close()


@pytest.mark.parametrize("in_clear", [None, (3, 2.0)])
def test_a_certificate_alert_in_clear_needs_the_longer_run(fed_broker: Any, in_clear: Any) -> None:
    """An alert before any key is agreed (forgeable by whoever sits on the path) does not count as the broker's
    own: the 3-refusal rule does not stop the device; only IN_CLEAR's longer run would (here shortened)."""
    import dataclasses
    import queue

    fb = fed_broker(["dev-a"], tls=True)
    forger = _CutShort(reply=BAD_CERTIFICATE_ALERT)
    events: queue.Queue[Any] = queue.Queue()
    settings = dataclasses.replace(mqtt_connect_settings(fb.devices["dev-a"]), port=forger.port)
    refusals = CertRefusals() if in_clear is None else CertRefusals(in_clear=in_clear)
    link = MqttLink(settings, events.put, reconnect_delay=(1, 1), cert_refusals=refusals)
    link.start()
    try:
        if in_clear is None:
            assert until(lambda: forger.accepted >= AUTHENTICATED[0] + 1, 15), f"only {forger.accepted} attempts"
            assert link.refused is None, f"a forged alert in clear stopped the device: {link.refused}"
        else:
            assert until(lambda: link.refused is not None, 15), "the alerts in clear were not seen as refusals"
            assert "bad certificate, during the handshake" in str(link.refused)
    finally:
        link.stop(timeout=1)
        forger.close()


@pytest.mark.parametrize("authenticated", [True, False])
def test_refusals_give_up_only_in_a_row_and_over_time(authenticated: bool) -> None:
    now = [0.0]
    r = CertRefusals(clock=lambda: now[0])
    alert = CertAlert("certificate revoked", authenticated)
    n, span = AUTHENTICATED if authenticated else r.in_clear
    for i in range(n - 1):
        now[0] = i * 1.0
        assert r.failed(alert) is None
    assert r.failed(None) is None  # a broker down in between: the count starts again
    for i in range(n - 1):
        now[0] = 100.0 + i * 0.1
        assert r.failed(alert) is None
    now[0] = 100.0 + (n - 1) * 0.1
    assert r.failed(alert) is None, "gave up within less than the least span"
    now[0] = 100.0 + span
    why = r.failed(alert)
    assert why is not None and "certificate revoked" in why
