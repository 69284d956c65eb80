"""The broker's TLS listener (docs/explanation/guarantees.md, "TLS"; docs/howto/devices.md).

Two adversaries against a real Mosquitto with the federation's TLS listener (client certificates
required):

- a client that speaks plain MQTT to the TLS port, with a device's valid password: it must get no CONNACK;
- a client holding a certificate and key signed by another federation's CA (the name of a real device,
  the right password): the handshake must fail, no CONNACK;
- a fake broker in the middle, presenting a server certificate of another CA for the same host: a device,
  with its own credentials' CA, must refuse to talk to it (no CONNECT, so its password never leaves).

A device with its own certificate and CA connects (the positive control).
"""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from mqtt_broker.state import BrokerFiles
from mqtt_broker.tls import ensure_ca_and_server
from tests.mqtt_broker.broker_testlib import FEDERATION, needs_mosquitto, try_connect
from transport.credentials import mqtt_connect_settings

pytestmark = needs_mosquitto


class FakeBroker:
    """A TLS server with another CA's certificate; records whether any byte of MQTT arrived after a handshake."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.handshakes = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(5)
        try:
            raw, _ = self.sock.accept()
        except OSError:
            return
        try:
            with self.ctx.wrap_socket(raw, server_side=True) as tls:
                self.handshakes += 1
                tls.settimeout(2)
                self.received = tls.recv(4096)
        except (OSError, ssl.SSLError):
            pass

    def close(self) -> None:
        self.sock.close()


def test_plaintext_foreign_certificates_and_a_fake_broker_are_refused(tmp_path: Path,
                                                                      attack_fed: Any) -> None:
    # dev-a's name and password; the adversary's certificate: dev-a of another federation, signed by its CA
    rb = attack_fed(["dev-a", "dev-b"], adversary="dev-a", view="foreign", federation=FEDERATION, tls=True)
    fake = None
    try:
        creds = rb.devices["dev-a"]
        good = mqtt_connect_settings(creds, use_tls=True)
        assert try_connect(good)[0] == 0  # positive control: its own certificate and CA
        # plain MQTT on the TLS port, valid password
        assert try_connect(replace(good, ssl_context=None))[0] is None
        # a certificate of another federation's CA, a real device's name and password
        foreign = rb.adversary
        assert foreign.tls is not None and creds.tls is not None
        ctx = ssl.create_default_context(cafile=str(creds.tls.ca_file))
        ctx.load_cert_chain(str(foreign.tls.cert_file), str(foreign.tls.key_file))
        assert try_connect(replace(good, ssl_context=ctx))[0] is None
        # a fake broker for 127.0.0.1 with a server certificate of another CA
        other_tls = BrokerFiles.at(tmp_path / "other").tls_dir  # the foreign device's federation
        t = ensure_ca_and_server(other_tls, "other", ["127.0.0.1", "localhost"])
        fake = FakeBroker(t.server_cert, t.server_key)
        assert try_connect(replace(good, port=fake.port))[0] is None
        assert fake.received == b"", "the device sent its CONNECT (and password) to a broker of another CA"
    finally:
        if fake is not None:
            fake.close()
