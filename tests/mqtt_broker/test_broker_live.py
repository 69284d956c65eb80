"""Access control on a live broker, run against Mosquitto and against the embedded broker.

Negative checks wait a short window only after a positive control proved that delivery works."""

from __future__ import annotations

import pytest
from broker_testlib import (
    FEDERATION,
    NEGATIVE_WINDOW_S,
    connect_probe,
    file_mode,
    matrix_topics,
    run_acl_matrix,
    secrets_of,
    try_connect,
)

from protocol.topics import Topics
from transport.credentials import mqtt_connect_settings

pytestmark = pytest.mark.integration
T = Topics(FEDERATION)


@pytest.mark.faults
def test_wrong_missing_and_unknown_credentials_are_refused(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    settings = mqtt_connect_settings(any_broker.creds["dev-a"])
    assert try_connect(settings)[0] == 0  # positive control
    rc, _ = try_connect(settings, password=settings.password + "x")
    assert rc != 0
    assert try_connect(settings, password="")[0] != 0
    assert try_connect(settings, no_credentials=True)[0] != 0
    assert try_connect(settings, username="dev-zz", client_id="dev-zz")[0] != 0
    # another device's password does not open this account
    other = any_broker.creds["dev-b"].password
    assert try_connect(settings, password=other)[0] != 0
    faults_ledger.unauthorised(f"connect: wrong, empty, missing, unknown, other's password ({any_broker.kind})", 5, 0)


@pytest.mark.faults
def test_device_cannot_publish_into_another_devices_update_topic(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    c = any_broker.creds
    coord, a, b = connect_probe(c["coordinator"]), connect_probe(c["dev-a"]), connect_probe(c["dev-b"])
    try:
        coord.subscribe(T.all_updates())
        a.publish(T.update_chunk("dev-b", 7, 0), b"forged by a")
        b.publish(T.update_chunk("dev-b", 7, 1), b"genuine b")
        assert coord.wait_for(lambda ms: any(p == b"genuine b" for _, p, _ in ms)), "positive control lost"
        a.publish(T.update_chunk("dev-a", 7, 0), b"genuine a")
        assert coord.wait_for(lambda ms: any(p == b"genuine a" for _, p, _ in ms))
        coord.wait_for(lambda ms: False, timeout=NEGATIVE_WINDOW_S)
        assert all(p != b"forged by a" for _, p, _ in coord.messages)
        assert sorted(coord.topics()) == [T.update_chunk("dev-a", 7, 0), T.update_chunk("dev-b", 7, 1)]
        faults_ledger.unauthorised(f"publish into another device's update topic ({any_broker.kind})", 1, 0)
    finally:
        for p in (coord, a, b):
            p.close()


@pytest.mark.faults
def test_device_cannot_read_another_devices_updates_acks_or_status(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    c = any_broker.creds
    coord, a, b = connect_probe(c["coordinator"]), connect_probe(c["dev-a"]), connect_probe(c["dev-b"])
    try:
        b.publish(T.status("dev-b"), b"online", retain=True)  # retained: must not leak to a either
        coord.subscribe(T.all_updates(), T.all_status())
        b.subscribe(T.ack("dev-b"))
        # a tries exact topics and wildcards; subscriptions are granted, deliveries are filtered
        a.subscribe(T.update_chunk("dev-b", 3, 0), T.ack("dev-b"), T.status("dev-b"), f"{T.prefix}/#", "#")
        b.publish(T.update_chunk("dev-b", 3, 0), b"b's update")
        coord.publish(T.ack("dev-b"), b"ack for b")
        coord.publish(T.round(), b"plan")
        assert coord.wait_for(lambda ms: any(p == b"b's update" for _, p, _ in ms))
        assert b.wait_for(lambda ms: any(p == b"ack for b" for _, p, _ in ms))
        assert a.wait_for(lambda ms: any(t == T.round() for t, _, _ in ms)), "a should still read the plan"
        assert coord.wait_for(lambda ms: any(t == T.status("dev-b") for t, _, _ in ms))
        a.wait_for(lambda ms: False, timeout=NEGATIVE_WINDOW_S)
        assert set(a.topics()) == {T.round()}, a.topics()
        faults_ledger.unauthorised(f"read another device's update, ack, status ({any_broker.kind})", 3, 0)
        b.publish(T.status("dev-b"), b"", retain=True)  # clear the retained status
    finally:
        for p in (coord, a, b):
            p.close()


@pytest.mark.faults
def test_devices_cannot_publish_plan_model_or_acks(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    c = any_broker.creds
    coord, a, b = connect_probe(c["coordinator"]), connect_probe(c["dev-a"]), connect_probe(c["dev-b"])
    digest = "cd" * 16
    try:
        b.subscribe(T.round(), T.model_filter(digest), T.ack("dev-b"))
        a.publish(T.round(), b"fake plan")
        a.publish(T.model_chunk(digest, 0), b"fake model")
        a.publish(T.ack("dev-b"), b"fake ack")
        coord.publish(T.model_chunk(digest, 1), b"real model")
        assert b.wait_for(lambda ms: any(p == b"real model" for _, p, _ in ms))
        b.wait_for(lambda ms: False, timeout=NEGATIVE_WINDOW_S)
        assert [p for _, p, _ in b.messages] == [b"real model"]
        faults_ledger.unauthorised(f"device publishes plan, model chunk, ack ({any_broker.kind})", 3, 0)
    finally:
        for p in (coord, a, b):
            p.close()


def test_retained_model_chunks_reach_a_device_that_subscribes_later(any_broker) -> None:  # type: ignore[no-untyped-def]
    c = any_broker.creds
    digest = "ef" * 16
    coord = connect_probe(c["coordinator"])
    chunks = {i: bytes([i]) * (1000 + i) for i in range(5)}
    try:
        for i, data in chunks.items():
            coord.publish(T.model_chunk(digest, i), data, retain=True)
    finally:
        coord.close()
    a = connect_probe(c["dev-a"])
    try:
        a.subscribe(T.model_filter(digest))
        assert a.wait_for(lambda ms: len(ms) >= len(chunks))
        got = {T.parse(t).chunk: p for t, p, retained in a.messages if retained}
        assert got == chunks
    finally:
        a.close()


@pytest.mark.faults
def test_acl_matrix_matches_the_generated_acl(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    expected, observed = run_acl_matrix(any_broker.files.acl, any_broker.creds, FEDERATION)
    assert len(expected) >= 10  # the experiment has positives
    missing, extra = expected - observed, observed - expected
    assert not missing, f"allowed by the ACL but not delivered: {sorted(missing)[:10]}"
    assert not extra, f"delivered although the ACL forbids it: {sorted(extra)[:10]}"
    # a sample of the design's promises, checked on the observed traffic itself
    assert ("coordinator", "dev-a", T.update_chunk("dev-a", 1, 0)) in observed
    assert ("dev-b", "coordinator", T.ack("dev-b")) in observed
    assert not any(sub == "dev-a" and topic == T.ack("dev-b") for sub, _, topic in observed)
    assert not any(pub != "coordinator" and topic == T.round() for _, pub, topic in observed)
    users, topics = len(any_broker.creds), len(matrix_topics(FEDERATION, sorted(any_broker.creds)))
    faults_ledger.unauthorised(f"live ACL matrix: deliveries the ACL forbids ({any_broker.kind})",
                               users * users * topics - len(expected), len(extra))


@pytest.mark.faults
def test_one_device_cannot_take_over_anothers_session(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    c = any_broker.creds
    b = connect_probe(c["dev-b"])
    a_settings = mqtt_connect_settings(c["dev-a"])
    try:
        b.subscribe(T.ack("dev-b"))
        intruders = [
            {"client_id": "dev-b"},  # dev-a's own password, dev-b's client id
            {"client_id": "dev-b", "username": "dev-b", "password": "wrong"},
            {"client_id": "dev-b", "username": "dev-b", "password": "wrong", "clean_session": False},
        ]
        for kw in intruders:
            rc, intruder = try_connect(a_settings, timeout=2.0, **kw)  # type: ignore[arg-type]
            if rc == 0:  # Mosquitto replaces the client id by the username: this is dev-a's own session
                assert any_broker.kind == "mosquitto"
                intruder.disconnect()
                intruder.loop_stop()
        coord = connect_probe(c["coordinator"])
        try:
            coord.publish(T.ack("dev-b"), b"still there")
            assert b.wait_for(lambda ms: any(p == b"still there" for _, p, _ in ms)), "dev-b lost its session"
            faults_ledger.unauthorised(f"take over another device's session ({any_broker.kind})", len(intruders), 0)
        finally:
            coord.close()
    finally:
        b.close()


@pytest.mark.faults
def test_state_files_are_private_and_hold_no_plaintext_secret(any_broker) -> None:  # type: ignore[no-untyped-def]
    files = any_broker.files
    assert file_mode(files.state_dir) == 0o700
    for path in [files.passwd, files.acl, files.mosquitto_conf, files.config, files.run_record, files.log,
                 *files.credentials_dir.glob("*.toml")]:
        assert file_mode(path) == 0o600, path
    public = [files.passwd, files.acl, files.mosquitto_conf, files.config, files.run_record, files.log]
    for secret in secrets_of(any_broker):
        for path in public:
            assert secret not in path.read_text(), f"a password appears in {path.name}"
    assert any_broker.creds["dev-a"].password in files.credentials("dev-a").read_text()


@pytest.mark.faults
def test_a_secure_rounds_messages_reach_only_the_device_they_are_addressed_to(any_broker, faults_ledger) -> None:  # type: ignore[no-untyped-def]
    """secreq/<b>: the shares the coordinator relays to b; secagg/<b>: b's keys and shares. Neither may be read
    by another device, nor written in b's name, nor forged into secreq/ by a device."""
    c = any_broker.creds
    coord, a, b = connect_probe(c["coordinator"]), connect_probe(c["dev-a"]), connect_probe(c["dev-b"])
    try:
        coord.subscribe(T.all_secagg())
        b.subscribe(T.secreq("dev-b"))
        a.subscribe(T.secreq("dev-b"), T.secagg("dev-b"), f"{T.prefix}/#")
        b.publish(T.secagg("dev-b"), b"b's keys")
        a.publish(T.secagg("dev-b"), b"keys in b's name")
        a.publish(T.secreq("dev-b"), b"forged shares for b")
        coord.publish(T.secreq("dev-b"), b"shares for b")
        assert coord.wait_for(lambda ms: any(p == b"b's keys" for _, p, _ in ms))
        assert b.wait_for(lambda ms: any(p == b"shares for b" for _, p, _ in ms))
        for p in (a, b, coord):
            p.wait_for(lambda ms: False, timeout=NEGATIVE_WINDOW_S)
        assert [m for _, m, _ in b.messages] == [b"shares for b"]
        assert [m for _, m, _ in coord.messages] == [b"b's keys"]
        assert not [t for t in a.topics() if "/secagg/" in t or "/secreq/" in t], a.topics()
        faults_ledger.unauthorised(f"secure-round topics: read, write in another's name, forge ({any_broker.kind})",
                                   4, 0)
    finally:
        for p in (coord, a, b):
            p.close()
