"""Security checks the broker suite (tests/mqtt_broker, also marked ``faults``) does not make: the
access rules Mosquitto really loads, per listener, against the design's role x topic x read/write
matrix; a device posing as another through its client id; and a whole federation run over TLS with
client certificates and debug logging, in which no password or private key appears in any log or
output, a device with a wrong password or without a certificate gets nowhere, and every file that
holds a secret is its owner's alone."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from broker_testlib import connect_probe, try_connect
from faultlib import FEDERATION, proc_federation, start_persistent_broker

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from mqtt_broker.acl import parse_acl
from mqtt_broker.state import BrokerFiles
from protocol import Topics
from transport.credentials import mqtt_connect_settings

pytestmark = [pytest.mark.faults, pytest.mark.integration]
T = Topics(FEDERATION)

# The design's topic table (docs/explanation/design.md) as a matrix, written out by hand: what each role may read (r) and write (w).
# "own" is the topic level naming the connecting user itself. Mosquitto applies the device patterns
# (%u) to every user, so the coordinator also holds the device rights under its own name.
MATRIX = {
    "device": {
        "round": "r",
        "model": "r",
        "update/own": "w",
        "update/other": "",
        "ack/own": "r",
        "ack/other": "",
        "status/own": "w",
        "status/other": "",
        "metrics/own": "w",
        "metrics/other": "",
        "other federation": "",
        "$SYS": "",
        "outside fl/": "",
    },
    "coordinator": {
        "round": "rw",
        "model": "rw",
        "update/own": "rw",
        "update/other": "rw",  # write: to empty what a device left retained there
        "ack/own": "rw",
        "ack/other": "w",
        "status/own": "rw",
        "status/other": "r",
        "metrics/own": "rw",
        "metrics/other": "rw",  # (same)
        "other federation": "",
        "$SYS": "",
        "outside fl/": "",
    },
}


def _topic(kind: str, me: str, other: str) -> str:
    who = me if kind.endswith("/own") else other
    return {
        "round": T.round(),
        "model": T.model_chunk("ab" * 32, 0),
        "other federation": f"fl/{FEDERATION}x/round",
        "$SYS": "$SYS/broker/uptime",
        "outside fl/": "x/round",
    }.get(kind) or {
        "update": T.update_chunk(who, 1, 0),
        "ack": T.ack(who),
        "status": T.status(who),
        "metrics": T.metrics(who),
    }[kind.split("/")[0]]


def _listeners(conf: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = []
    for line in conf.splitlines():
        key, _, value = line.strip().partition(" ")
        if key == "listener":
            blocks.append({"listener": value})
        elif blocks and key and not key.startswith("#"):
            blocks[-1][key] = value
    return blocks


def test_every_listener_enforces_the_acl_rendered_from_the_design(tmp_path: Path, faults_ledger: Any) -> None:
    fb = start_persistent_broker(tmp_path, ["dev-a", "dev-b"], tls=True)
    try:
        files = BrokerFiles.at(fb.state_dir)
        blocks = _listeners(files.mosquitto_conf.read_text())
        assert len(blocks) == 2  # plain and TLS
        for b in blocks:  # no listener without authentication, access rules or the username as client id
            assert (
                b.get("allow_anonymous"),
                b.get("password_file"),
                b.get("acl_file"),
                b.get("use_username_as_clientid"),
            ) == ("false", str(files.passwd), str(files.acl), "true"), b
        assert blocks[1]["require_certificate"] == "true" and "use_identity_as_username" not in blocks[1]
        acl = parse_acl(Path(blocks[0]["acl_file"]).read_text())
        tried = wrong = 0
        for role, user, other in (
            ("device", "dev-a", "dev-b"),
            ("device", "dev-b", "dev-a"),
            ("coordinator", "coordinator", "dev-a"),
        ):
            for kind, rights in MATRIX[role].items():
                for access, letter in (("read", "r"), ("write", "w")):
                    allowed = acl.allows(user, user, _topic(kind, user, other), access)
                    assert allowed == (letter in rights), (role, user, kind, access)
                    tried += letter not in rights
                    wrong += allowed and letter not in rights
        faults_ledger.unauthorised("ACL cells outside a role (role x topic x read/write)", tried, wrong)
    finally:
        fb.broker.stop()


def test_a_device_posing_as_another_through_its_client_id_gets_nothing(
    tmp_path: Path, faults_ledger: Any
) -> None:
    fb = start_persistent_broker(tmp_path, ["dev-a", "dev-b"])
    coord = connect_probe(fb.coordinator)
    try:
        coord.subscribe(T.all_updates())
        a = mqtt_connect_settings(fb.devices["dev-a"])
        # dev-b's name with dev-a's password: refused
        assert try_connect(a, client_id="dev-b", username="dev-b")[0] not in (0, None)
        # dev-a's credentials, dev-b's client id: accepted as dev-a (the username is the client id)
        rc, client = try_connect(a, client_id="dev-b")
        assert rc == 0
        client.publish(T.update_chunk("dev-b", 1, 0), b"as dev-b", qos=1).wait_for_publish(3)
        client.publish(T.status("dev-b"), b"as dev-b", qos=1, retain=True).wait_for_publish(3)
        client.publish(T.update_chunk("dev-a", 1, 0), b"as itself", qos=1).wait_for_publish(3)
        assert coord.wait_for(
            lambda ms: any(p == b"as itself" for _, p, _ in ms)
        )  # in order: the forgeries first
        assert [p for _, p, _ in coord.messages] == [b"as itself"]
        client.disconnect()
        client.loop_stop()
        faults_ledger.unauthorised("connect under another device's name", 1, 0)
        faults_ledger.unauthorised("publish as another device via its client id", 2, 0)
    finally:
        coord.close()
        fb.broker.stop()


def _secrets(state: Path) -> dict[str, str]:
    """Every password (from the credentials files) and every private key's base64 lines."""
    import tomllib

    out = {}
    for creds in (state / "credentials").glob("*.toml"):
        out[f"password of {creds.stem}"] = tomllib.loads(creds.read_text())["password"]
    for key in (state / "tls").rglob("*.key"):
        for i, line in enumerate(key.read_text().splitlines()):
            if len(line) >= 40 and not line.startswith("-----"):
                out[f"{key.name} line {i}"] = line
    return out


@pytest.mark.slow
def test_a_federation_over_tls_leaks_no_secret(
    tmp_path: Path, digits: Any, digits_shards: list, caplog: pytest.LogCaptureFixture, faults_ledger: Any
) -> None:
    fed = proc_federation(tmp_path, digits, ["dev-0", "dev-1"], rounds=1, broker={"tls": True})
    fed.verbose = "-vv"  # debug logging everywhere
    state = fed.fb.state_dir
    try:
        assert all(
            c.tls is not None and c.tls.cert_file for c in fed.fb.devices.values()
        )  # they connect over TLS
        # a device with a wrong password (its own process), and one without a client certificate
        bad = state / "credentials-wrong" / "dev-1.toml"
        bad.parent.mkdir(mode=0o700)
        text = (state / "credentials/dev-1.toml").read_text()
        bad.write_text(text.replace(fed.fb.devices["dev-1"].password, "not-the-password"))
        bad.chmod(0o600)
        wrong = fed.tmp / "dev-1-wrong.toml"
        wrong.write_text(
            fed.dev_tomls["dev-1"].read_text().replace(str(state / "credentials/dev-1.toml"), str(bad))
        )
        fed.dev_tomls["dev-1-wrong"] = wrong
        intruder = fed.start_device("dev-1-wrong")
        nocert = dataclasses.replace(
            fed.fb.devices["dev-0"],
            tls=dataclasses.replace(fed.fb.devices["dev-0"].tls, cert_file=None, key_file=None),
        )  # type: ignore[arg-type]
        stranger = EdgeClient(
            EdgeSettings(state_dir=str(tmp_path / "stranger"), device="cpu"), nocert, digits_shards[0]
        )
        stranger.start()
        assert intruder.popen.wait(60) == 2 and "refused" in intruder.text()
        del fed.procs["dev-1-wrong"]
        for d in ("dev-0", "dev-1"):
            fed.start_device(d)
        fed.start_coordinator()
        fed.wait_all(180)
        assert stranger.plan is None and not stranger.link.connected.is_set()
        stranger.stop()
        assert "peer did not return a certificate" in (state / "broker.log").read_text()
        faults_ledger.unauthorised("connect with a wrong password (edge process)", 1, 0)
        faults_ledger.unauthorised("connect over TLS without a client certificate", 1, 0)
        time.sleep(0.2)
        # no secret in any output, log or file -- except the files meant to hold them
        secrets = _secrets(state)
        holders = {*(state / "credentials").glob("*.toml"), *(state / "tls").rglob("*.key"), bad}
        outputs = {"pytest log capture": caplog.text}
        for path in tmp_path.rglob("*"):
            if path.is_file() and path not in holders:
                outputs[str(path.relative_to(tmp_path))] = path.read_bytes().decode("latin-1")
        assert any(k.endswith(".log") for k in outputs) and len(secrets) >= 8
        leaks = [(what, where) for what, s in secrets.items() for where, text in outputs.items() if s in text]
        assert not leaks, leaks
        for path in holders:  # readable by its owner only, in folders only its owner can enter
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.stat().st_uid == os.getuid()
        print(f"{len(secrets)} secrets searched in {len(outputs)} outputs and files: none found")
    finally:
        fed.stop()
