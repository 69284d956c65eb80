"""Close the open session of a revoked or re-keyed identity on a running Mosquitto whose TLS listener takes the
certificate's CN as the username (``--identity-as-username``).

In that mode a reload (SIGHUP) re-reads the revocation list (:mod:`mqtt_broker.crl`) for new handshakes but
checks no open connection against it, and no password is asked, so a removed password entry closes nothing.
What Mosquitto 2.0 does close is an older connection of the same client id, and every client id here is its
username (``use_username_as_clientid``): the CA's holder signs a one-off certificate for that name (valid ten
minutes, its key never leaves this process's temporary file), connects with it and a clean session (the old
connection is closed and its session, queued messages included, dropped), disconnects, and puts the one-off
certificate on the revocation list too. The revoked certificate itself fails the handshake from the reload on.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import signal
import ssl
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mqtt_broker.config import BrokerConfig
from mqtt_broker.crl import load_ca, revoke_serials
from mqtt_broker.process import BrokerError, recorded_process
from mqtt_broker.state import BrokerFiles

__all__ = ["close_identity_session", "identity_mode"]

log = logging.getLogger(__name__)

ONE_OFF_VALIDITY = dt.timedelta(minutes=10)
RELOAD_MARK = b"Reloading config."


def identity_mode(cfg: BrokerConfig) -> bool:
    return cfg.tls and cfg.use_identity_as_username


def _one_off(tls_dir: Path, name: str, folder: Path) -> tuple[int, Path, Path]:
    """A certificate for CN ``name`` signed by the federation's CA; (serial, cert file, key file), both 0600."""
    ca, ca_key = load_ca(tls_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    serial = int.from_bytes(secrets.token_bytes(16), "big") >> 1
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(serial)
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + ONE_OFF_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = []
    for data in (cert.public_bytes(serialization.Encoding.PEM),
                 key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())):
        fd, path = tempfile.mkstemp(dir=folder, suffix=".pem")  # 0600
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        files.append(Path(path))
    return serial, files[0], files[1]


def _reload_and_wait(pid: int, log_file: Path, timeout: float) -> bool:
    """SIGHUP the broker and wait until its log says it reloaded (the new revocation list is in force)."""
    start = log_file.stat().st_size if log_file.exists() else 0
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(log_file, "rb") as fh:
                fh.seek(start)
                if RELOAD_MARK in fh.read():
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def _take_over(cfg: BrokerConfig, ca_file: Path, cert: Path, key: Path, client_id: str, timeout: float) -> bool:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.load_cert_chain(str(cert), str(key))
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True,
                         protocol=mqtt.MQTTv311)
    client.tls_set_context(ctx)
    answered = threading.Event()
    result: dict[str, int] = {}

    def on_connect(c: object, userdata: object, flags: object, reason_code: Any, properties: object) -> None:
        result["rc"] = int(reason_code.value)
        answered.set()

    client.on_connect = on_connect
    try:
        client.connect(cfg.tls_connect_host, cfg.tls_port, keepalive=30)
    except (OSError, ssl.SSLError) as exc:
        log.warning("could not reach the TLS listener %s:%d to close %s's session: %s", cfg.tls_connect_host,
                    cfg.tls_port, client_id, exc)
        return False
    deadline = time.monotonic() + timeout
    while not answered.is_set() and time.monotonic() < deadline:
        if client.loop(timeout=0.05) not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_AGAIN):
            break
    client.disconnect()
    client.loop(timeout=0.2)
    return result.get("rc") == 0


def close_identity_session(state_dir: str | Path, user: str, timeout: float = 5.0) -> bool:
    """Close ``user``'s open connection (and drop its session) on the running Mosquitto recorded in
    ``state_dir``, after making it reload the revocation list. True when done; False when the federation does
    not take the certificate's CN as the username or no Mosquitto is recorded (nothing to close); raises
    :class:`BrokerError` when the broker did not reload or refused the one-off connection."""
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    rec = recorded_process(files.state_dir)
    if not identity_mode(cfg) or rec is None or rec.kind != "mosquitto":
        return False
    if not any(line.startswith("crlfile ") for line in files.mosquitto_conf.read_text().splitlines()):
        # written at start only: a broker started by a release without the list re-reads none at the reload
        raise BrokerError(f"the running broker (pid {rec.pid}) was started without the revocation list, so {user}'s "
                          f"old certificate would still connect: restart it (flayer broker stop, then start)")
    if not _reload_and_wait(rec.pid, files.log, timeout):
        raise BrokerError(f"the broker (pid {rec.pid}) did not log a reload within {timeout:.0f} s; restart it "
                          f"(flayer broker stop, then start) to close {user}'s connection")
    serial, cert, key = _one_off(files.tls_dir, user, files.tls_dir)
    try:
        closed = _take_over(cfg, files.tls_dir / "ca.crt", cert, key, user, timeout)
    finally:
        cert.unlink(missing_ok=True)
        key.unlink(missing_ok=True)
        revoke_serials(files.tls_dir, [serial])  # were the key file ever copied, it opens nothing
        _reload_and_wait(rec.pid, files.log, timeout)
    if not closed:
        raise BrokerError(f"the broker refused the connection that closes {user}'s session; restart it "
                          f"(flayer broker stop, then start) to close that connection")
    log.info("closed the open session of %s", user)
    return True
