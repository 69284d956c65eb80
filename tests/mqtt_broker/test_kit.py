"""Startup kits and revocation in the broker's state folder (no running broker needed)."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig, BrokerConfigError, add_device, write_broker_files
from mqtt_broker.kit import revoke_device, write_kit
from mqtt_broker.passwords import read_passwd
from transport.credentials import Credentials
from transport.kit import KitError, unpack_kit


def test_a_kit_holds_the_device_files_with_relative_paths_and_unpacks(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", tls=True, port=1883, tls_port=8883), state)
    creds = add_device(state, "dev-7")
    kit = write_kit(state, "dev-7", tmp_path / "out" / "dev-7.tar.gz")
    assert stat.S_IMODE(kit.stat().st_mode) == 0o600
    with tarfile.open(kit) as tar:
        assert all(stat.S_IMODE(m.mode) == 0o600 for m in tar.getmembers())
        text = b"".join(tar.extractfile(m).read() for m in tar.getmembers())  # type: ignore[union-attr]
    assert str(state).encode() not in text
    with pytest.raises(BrokerConfigError, match="already exists"):
        write_kit(state, "dev-7", kit)
    with pytest.raises(BrokerConfigError, match="not a device"):
        write_kit(state, "coordinator", tmp_path / "c.tar.gz")
    toml = unpack_kit(kit)
    assert toml == tmp_path / "out" / "dev-7" / "device.toml"
    got = Credentials.load(toml.parent / "credentials.toml")
    assert got.password == creds.password and got.tls is not None
    assert got.tls.cert_file == toml.parent / "tls/client.crt" and got.tls.cert_file.read_bytes().startswith(b"-----")
    assert unpack_kit(kit) == toml  # a restart reuses the folder
    other = add_device(state, "dev-8")
    assert other.username == "dev-8"
    with pytest.raises(KitError, match="holds another device's kit"):
        unpack_kit(write_kit(state, "dev-8", tmp_path / "dev-8.tar.gz"), toml.parent)


def test_revocation_removes_the_device_and_a_new_kit_lets_it_back(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    add_device(state, "dev-1")
    add_device(state, "dev-2")
    assert revoke_device(state, "dev-1") is True
    assert "dev-1" not in read_passwd(state / "passwd") and "dev-2" in read_passwd(state / "passwd")
    assert not (state / "credentials/dev-1.toml").exists()
    assert set(json.loads((state / "revoked.json").read_text())) == {"dev-1"}
    assert revoke_device(state, "dev-1") is False  # already revoked: nothing more to do
    with pytest.raises(BrokerConfigError, match="no device 'dev-9'"):
        revoke_device(state, "dev-9")
    with pytest.raises(BrokerConfigError, match="coordinator"):
        revoke_device(state, "coordinator")
    add_device(state, "dev-1")
    assert json.loads((state / "revoked.json").read_text()) == {}
    assert "dev-1" in read_passwd(state / "passwd")
