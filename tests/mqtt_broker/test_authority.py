"""The federation's authority: certificates, the signed revocation list, kits that carry them, re-keyed kits."""

from __future__ import annotations

import stat
import tarfile
from pathlib import Path

import pytest

from edge_client.certified_keys import CertifiedKeys, round_keys
from mqtt_broker import BrokerConfig, BrokerConfigError, add_device, write_broker_files
from mqtt_broker.authority import AUTHORITY_KEY, authority_public, current_cert, read_revocations
from mqtt_broker.kit import revoke_device, write_kit
from mqtt_broker.rekey import rekey
from protocol import SignatureError, SigningKey
from protocol.certs import issue_cert, parse_cert, parse_revocations, sign_revocations
from transport.kit import KitError, unpack_kit


def test_certificates_bind_every_field_and_only_the_authority_signs_them() -> None:
    auth, dev = SigningKey.generate(), SigningKey.generate()
    cert = issue_cert(auth, "f1", "dev-1", dev.public, 3, 1000)
    assert parse_cert(cert.to_text(), auth.public, "f1") == cert
    with pytest.raises(SignatureError, match="federation"):
        parse_cert(cert.to_text(), auth.public, "f2")
    for field, value in (('"serial": 3', '"serial": 4'), ('"device": "dev-1"', '"device": "dev-2"'),
                         ('"issued": 1000', '"issued": 1001')):
        with pytest.raises(SignatureError, match="not signed by this federation's authority"):
            parse_cert(cert.to_text().replace(field, value), auth.public, "f1")
    minted = issue_cert(SigningKey.generate(), "f1", "dev-9", dev.public, 1, 1000)  # anyone else's key
    with pytest.raises(SignatureError, match="not signed"):
        parse_cert(minted.to_text(), auth.public, "f1")
    revs = sign_revocations(auth, "f1", 2, 5, [("dev-1", "3")])
    assert parse_revocations(revs.to_text(), auth.public, "f1").revokes("dev-1", 3)
    with pytest.raises(SignatureError, match="not signed"):
        parse_revocations(revs.to_text().replace('"version": 2', '"version": 9'), auth.public, "f1")


def test_the_authority_lives_in_the_state_folder_and_kits_carry_certificates(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    assert stat.S_IMODE((state / AUTHORITY_KEY).stat().st_mode) == 0o600
    assert AUTHORITY_KEY.encode() not in (state / "credentials/coordinator.toml").read_bytes()
    creds = add_device(state, "dev-1")
    kit = write_kit(state, "dev-1", tmp_path / "dev-1.tar.gz")
    with tarfile.open(kit) as tar:
        names = sorted(tar.getnames())
    assert names == ["START", "authority.pub", "credentials.toml", "device.cert", "device.toml"]
    cert = current_cert(state, "f1", "dev-1")
    assert cert is not None and cert.serial == 1 and cert.key == creds.signer().public

    rekey(state, "dev-1")  # a higher serial; the old certificate on the signed list
    new = current_cert(state, "f1", "dev-1")
    assert new is not None and new.serial == 2
    revs = read_revocations(state, "f1")
    assert revs is not None and revs.version == 1 and revs.revokes("dev-1", 1) and not revs.revokes("dev-1", 2)
    with pytest.raises(BrokerConfigError, match="already exists"):
        write_kit(state, "dev-1", kit)  # no replace asked
    add_device(state, "dev-2")
    other = write_kit(state, "dev-2", tmp_path / "dev-2.tar.gz")
    with pytest.raises(BrokerConfigError, match="not a kit of this device"):
        write_kit(state, "dev-1", other, replace=True)
    toml = unpack_kit(kit)
    (toml.parent / "state").mkdir()
    (toml.parent / "state/ledger.json").write_text("kept")
    assert write_kit(state, "dev-1", kit, replace=True) == kit  # the same device's kit: replaced
    assert unpack_kit(kit) == toml  # restarted in its folder: new credentials, its state kept
    assert (toml.parent / "state/ledger.json").read_text() == "kept"
    assert str(new.serial) in (toml.parent / "device.cert").read_text()
    with pytest.raises(KitError, match="holds another device's kit"):
        unpack_kit(other, toml.parent)

    revoke_device(state, "dev-2")
    revs = read_revocations(state, "f1")
    assert revs is not None and revs.version == 2 and revs.revokes("dev-2", 1)


def test_a_device_believes_certified_keys_refuses_revoked_ones_and_rollbacks(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    for d in ("dev-1", "dev-2"):
        add_device(state, d)
        write_kit(state, d, tmp_path / f"{d}.tar.gz")
    pub = authority_public(state)
    assert pub is not None
    own = (state / "certs/dev-1.json").read_bytes()
    keys = CertifiedKeys("f1", pub, tmp_path / "dev-1-state", own)
    old2 = (state / "certs/dev-2.json").read_bytes()
    certs, _, admit = round_keys(keys)  # one secure round's: the certificates its messages carry
    with pytest.raises(SignatureError, match="dev-2"):
        certs.key_for("f1", "dev-2")  # none carried yet
    assert admit is not None and admit("dev-2", old2) is None
    assert certs.key_for("f1", "dev-2") == parse_cert(old2, pub, "f1").key
    v1 = (rekey(state, "dev-2"), (state / "revocation_list.json").read_bytes())[1]
    revoke_device(state, "dev-2")
    v2 = (state / "revocation_list.json").read_bytes()
    assert keys.offer_revocations(v2) is not None
    _, _, admit = round_keys(keys)  # a later round
    assert admit is not None and "revoked" in (admit("dev-2", old2) or "")  # still signed, on the list
    assert keys.offer_revocations(v1) is None  # a rollback
    again = CertifiedKeys("f1", pub, tmp_path / "dev-1-state", own)  # the highest version survives a restart
    assert again.revocations is not None and again.revocations.version == 2
    assert again.offer_revocations(v1) is None


def test_rekey_kit_replaces_the_same_devices_kit_and_names_the_flag_for_another_file(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from cli.main import main

    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    for d in ("dev-1", "dev-2"):
        add_device(state, d)
        write_kit(state, d, tmp_path / f"{d}.tar.gz")
    before = (tmp_path / "dev-1.tar.gz").read_bytes()
    assert main(["broker", "rekey", "dev-1", "--state-dir", str(state), "--kit", str(tmp_path / "dev-2.tar.gz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a kit of dev-1" in err[0] and "--kit" in err[0]
    assert current_cert(state, "f1", "dev-1").serial == 1  # type: ignore[union-attr]  # nothing re-keyed
    assert main(["broker", "rekey", "dev-1", "--state-dir", str(state), "--kit", str(tmp_path / "dev-1.tar.gz")]) == 0
    out = capsys.readouterr().out
    assert "startup kit" in out and "no running broker recorded" in out
    assert (tmp_path / "dev-1.tar.gz").read_bytes() != before
    with tarfile.open(tmp_path / "dev-1.tar.gz") as tar:
        cert = tar.extractfile("device.cert").read()  # type: ignore[union-attr]
        listed = tar.extractfile("revocations.json").read()  # type: ignore[union-attr]
    pub = authority_public(state)
    assert pub is not None and parse_cert(cert, pub, "f1").serial == 2
    assert parse_revocations(listed, pub, "f1").revokes("dev-1", 1)
