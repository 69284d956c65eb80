"""The TLS listener: federation CA, server certificate for loopback names, client certificates."""

from __future__ import annotations

import ssl
from dataclasses import replace
from pathlib import Path

import pytest
from broker_testlib import (
    FEDERATION,
    connect_probe,
    file_mode,
    needs_mosquitto,
    try_connect,
    wait_connectable,
)

from mqtt_broker import BrokerConfig, add_device, load_credentials, start_broker
from mqtt_broker.state import write_broker_files
from protocol.topics import Topics
from transport.credentials import mqtt_connect_settings

pytestmark = [pytest.mark.integration, needs_mosquitto]
T = Topics(FEDERATION)


def test_device_with_certificate_and_password_talks_over_tls(mosquitto_tls) -> None:  # type: ignore[no-untyped-def]
    c = mosquitto_tls.creds
    coord = connect_probe(c["coordinator"], use_tls=True)
    dev = connect_probe(c["dev-a"], use_tls=True)
    try:
        coord.subscribe(T.all_updates())
        dev.publish(T.update_chunk("dev-a", 0, 0), b"over tls")
        assert coord.wait_for(lambda ms: [p for _, p, _ in ms] == [b"over tls"])
        assert dev.client._ssl  # really a TLS socket
    finally:
        coord.close()
        dev.close()


@pytest.mark.faults
def test_refused_without_certificate_with_foreign_certificate_or_wrong_password(mosquitto_tls, tmp_path,  # type: ignore[no-untyped-def]
                                                                                faults_ledger) -> None:
    creds = mosquitto_tls.creds["dev-a"]
    good = mqtt_connect_settings(creds, use_tls=True)
    assert try_connect(good)[0] == 0  # positive control
    # no client certificate: the TLS handshake fails, no CONNACK ever comes
    no_cert = mqtt_connect_settings(creds, use_tls=True, client_cert=False)
    assert try_connect(no_cert)[0] is None
    # a certificate from another federation's CA
    other = write_broker_files(BrokerConfig(federation="other", tls=True, persistence=False), tmp_path / "other")
    foreign = add_device(other.state_dir, "dev-a")
    assert foreign.tls is not None and creds.tls is not None
    ctx = ssl.create_default_context(cafile=str(creds.tls.ca_file))
    ctx.load_cert_chain(str(foreign.tls.cert_file), str(foreign.tls.key_file))
    assert try_connect(replace(good, ssl_context=ctx))[0] is None
    # the right certificate but a wrong password
    assert try_connect(good, password="wrong")[0] not in (0, None)
    faults_ledger.unauthorised("TLS connect: no client certificate, another CA's, wrong password", 3, 0)


def test_server_certificate_names_loopback_and_is_checked(mosquitto_tls) -> None:  # type: ignore[no-untyped-def]
    settings = mqtt_connect_settings(mosquitto_tls.creds["dev-a"], use_tls=True)
    assert try_connect(replace(settings, host="localhost"))[0] == 0
    # the client verifies the broker: a context trusting only the system CAs refuses it
    system_only = ssl.create_default_context()
    assert try_connect(replace(settings, ssl_context=system_only))[0] is None


@pytest.mark.faults
def test_key_files_are_private_and_certificates_public(mosquitto_tls) -> None:  # type: ignore[no-untyped-def]
    tls_dir: Path = mosquitto_tls.files.tls_dir
    keys = sorted(tls_dir.rglob("*.key"))
    assert {k.name for k in keys} >= {"ca.key", "server.key", "dev-a.key", "dev-b.key", "coordinator.key"}
    for key in keys:
        assert file_mode(key) == 0o600, key
    for cert in tls_dir.rglob("*.crt"):
        assert file_mode(cert) == 0o644, cert
    for secret in (c.password for c in mosquitto_tls.creds.values()):
        assert all(secret not in p.read_text() for p in tls_dir.rglob("*") if p.is_file())


@pytest.mark.faults
def test_identity_as_username_binds_the_account_to_the_certificate(tmp_path: Path, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    cfg = BrokerConfig(federation=FEDERATION, tls=True, use_identity_as_username=True, persistence=False)
    with start_broker(cfg, tmp_path, kind="mosquitto") as broker:
        a, b = add_device(tmp_path, "dev-a"), add_device(tmp_path, "dev-b")
        broker.reload()
        wait_connectable(b)
        coord = connect_probe(load_credentials(tmp_path, "coordinator"))
        try:
            coord.subscribe(T.all_updates())
            # dev-a's certificate, claiming to be dev-b with a made-up password: it is dev-a all the same
            # (both go out on one connection, in order: had the forgery passed, it would arrive first)
            rc, client = try_connect(mqtt_connect_settings(a, use_tls=True), username="dev-b", client_id="dev-b",
                                     password="anything")
            assert rc == 0
            client.publish(T.update_chunk("dev-b", 0, 0), b"forged", qos=1).wait_for_publish(3)
            client.publish(T.update_chunk("dev-a", 0, 0), b"as itself", qos=1).wait_for_publish(3)
            assert coord.wait_for(lambda ms: any(p == b"as itself" for _, p, _ in ms))
            assert [p for _, p, _ in coord.messages] == [b"as itself"]
            faults_ledger.unauthorised("TLS identity as username: publish as another device", 1, 0)
            client.disconnect()
            client.loop_stop()
        finally:
            coord.close()


@pytest.mark.faults
def test_optional_client_certificate_still_needs_the_password(tmp_path: Path, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    cfg = BrokerConfig(federation=FEDERATION, tls=True, require_certificate=False, persistence=False)
    with start_broker(cfg, tmp_path, kind="mosquitto") as broker:
        dev = add_device(tmp_path, "dev-a")
        broker.reload()
        wait_connectable(dev, use_tls=True)
        no_cert = mqtt_connect_settings(dev, use_tls=True, client_cert=False)
        assert try_connect(no_cert)[0] == 0
        assert try_connect(no_cert, password="wrong")[0] not in (0, None)
        faults_ledger.unauthorised("TLS without a certificate (optional): wrong password", 1, 0)
