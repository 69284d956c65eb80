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


def test_a_kit_names_the_model_code_its_device_accepts(tmp_path: Path) -> None:
    from edge_client.config import load_device_config
    from flayer.config import ConfigError

    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    add_device(state, "dev-1")
    add_device(state, "dev-2")
    kit = write_kit(state, "dev-1", tmp_path / "dev-1.tar.gz", ["fedmodel:build", "fedmodel:build"])
    with pytest.raises(KitError, match="names code this device would run: entry point 'fedmodel:build'"):
        unpack_kit(kit)  # the owner has not allowed the kit's code
    assert not (tmp_path / "dev-1").exists()
    toml = unpack_kit(kit, allowed_entry_points=["fedmodel:build"])
    text = toml.read_text().replace('path = "data"', f'path = "{tmp_path}"')
    toml.write_text(text)
    assert load_device_config(toml).edge.allow_entry_points == ("fedmodel:build",)
    plain = unpack_kit(write_kit(state, "dev-2", tmp_path / "dev-2.tar.gz"))
    plain.write_text(plain.read_text().replace('path = "data"', f'path = "{tmp_path}"'))
    assert load_device_config(plain).edge.allow_entry_points == ()  # the built-ins only
    add_device(state, "dev-3")  # a name that could break out of its TOML string stays a string, and is refused
    odd = unpack_kit(write_kit(state, "dev-3", tmp_path / "dev-3.tar.gz", ['x:y"]\nexit_when_finished = false #']),
                     allow_code=True)
    odd.write_text(odd.read_text().replace('path = "data"', f'path = "{tmp_path}"'))
    with pytest.raises(ConfigError, match="is not an entry point"):
        load_device_config(odd)


def test_add_device_allow_entry_point_goes_into_the_kit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.common import CliError
    from cli.main import main

    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    kit = tmp_path / "dev-3.tar.gz"
    assert main(["broker", "add-device", "dev-3", "--state-dir", str(state), "--kit", str(kit),
                 "--allow-entry-point", "fedmodel:build"]) == 0
    assert 'allow_entry_points = ["fedmodel:build"]' in unpack_kit(kit, allow_code=True).read_text()
    assert (tmp_path / "dev-3/START").read_text() == "flayer edge --kit dev-3.tar.gz --data ./data " \
        "--allow-entry-point fedmodel:build\n"  # the start command names the code the owner allows
    for argv in (["--allow-entry-point", "fedmodel:build"],
                 ["--kit", str(tmp_path / "dev-4.tar.gz"), "--allow-entry-point", "no-colon"]):
        try:
            rc = main(["broker", "add-device", "dev-4", "--state-dir", str(state), *argv])
        except CliError as exc:
            rc, msg = 2, str(exc)
        else:
            msg = capsys.readouterr().err
        assert rc != 0 and "allow-entry-point" in msg, msg
    assert not (state / "credentials/dev-4.toml").exists()  # refused before the device was created
