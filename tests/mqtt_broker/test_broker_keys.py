"""Signing keys in the broker's state folder: made with the credentials, in every kit, re-keyed, revoked."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig, BrokerConfigError, add_device, load_credentials, write_broker_files
from mqtt_broker.keys import read_key_registry, registry_path
from mqtt_broker.kit import revoke_device, write_kit
from mqtt_broker.rekey import rekey
from mqtt_broker.state import save_credentials
from transport.credentials import Credentials
from transport.kit import unpack_kit


def _state(tmp: Path) -> Path:
    state = tmp / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    return state


def test_keys_are_made_with_the_credentials_and_registered(tmp_path: Path) -> None:
    state = _state(tmp_path)
    dev = add_device(state, "dev-1")
    coord = load_credentials(state, "coordinator")
    observer = load_credentials(state, "observer")
    coord_pub, devices = read_key_registry(registry_path(state))
    assert coord.signer().public == coord_pub and not coord.coordinator_key
    assert dev.signer().public == devices["dev-1"] and dev.coordinator() == coord_pub
    assert observer.coordinator() == coord_pub and not observer.signing_key  # observers sign nothing
    for path in (registry_path(state), state / "credentials/dev-1.toml", state / "credentials/coordinator.toml"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert dev.signing_key not in repr(dev)
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)  # a restart keeps every key
    assert load_credentials(state, "dev-1").signing_key == dev.signing_key
    assert load_credentials(state, "coordinator").signing_key == coord.signing_key


def test_the_kit_carries_the_devices_key_and_the_coordinators_public_key(tmp_path: Path) -> None:
    state = _state(tmp_path)
    dev = add_device(state, "dev-7")
    got = Credentials.load(unpack_kit(write_kit(state, "dev-7", tmp_path / "dev-7.tar.gz")).parent / "credentials.toml")
    assert got.signing_key == dev.signing_key
    assert got.coordinator() == load_credentials(state, "coordinator").signer().public


def test_rotation_and_revocation_replace_or_remove_the_registered_key(tmp_path: Path) -> None:
    state = _state(tmp_path)
    old = add_device(state, "dev-1").signer().public
    add_device(state, "dev-2")
    new = rekey(state, "dev-1").signer().public
    assert new != old and read_key_registry(registry_path(state))[1]["dev-1"] == new
    rotated = add_device(state, "dev-1", rotate=True).signer().public  # a new password is a new key too
    assert rotated not in (old, new) and read_key_registry(registry_path(state))[1]["dev-1"] == rotated
    coord_old = load_credentials(state, "coordinator").signer().public
    coord_new = rekey(state, "coordinator").signer().public
    assert coord_new != coord_old and read_key_registry(registry_path(state))[0] == coord_new
    for user in ("dev-1", "dev-2", "observer"):  # every credentials file carries the new coordinator key
        assert load_credentials(state, user).coordinator() == coord_new
    assert revoke_device(state, "dev-2")
    assert "dev-2" not in read_key_registry(registry_path(state))[1]
    with pytest.raises(BrokerConfigError, match="observer"):
        rekey(state, "observer")


def test_a_folder_of_an_earlier_release_gets_keys_on_the_next_start(tmp_path: Path) -> None:
    state = _state(tmp_path)
    dev = add_device(state, "dev-1")
    for user in ("dev-1", "coordinator", "observer"):  # as an earlier release wrote them: no keys
        c = load_credentials(state, user)
        save_credentials(Credentials(c.federation, c.role, c.username, c.password, c.host, c.port, c.max_packet_size),
                         state / f"credentials/{user}.toml")
    registry_path(state).unlink()
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    again = load_credentials(state, "dev-1")
    coord = load_credentials(state, "coordinator")
    assert again.password == dev.password and again.signing_key and again.coordinator() == coord.signer().public
    assert read_key_registry(registry_path(state)) == (coord.signer().public, {"dev-1": again.signer().public})


def test_a_sites_devices_believe_the_central_coordinator_and_central_learns_their_keys(tmp_path: Path) -> None:
    from mqtt_broker.bridge import set_gateway
    from mqtt_broker.state import add_gateway

    central = _state(tmp_path)
    add_gateway(central, "site-a", ["dev-1"])
    site = tmp_path / "site"
    site_cfg = BrokerConfig(federation="f1", port=1884, persistence=True)
    set_gateway(site, site_cfg, central / "credentials/site-a.toml", "127.0.0.1:1883", 5, (1, 1))
    write_broker_files(site_cfg, site)
    dev = add_device(site, "dev-1")
    central_coord = load_credentials(central, "coordinator").signer().public
    assert dev.coordinator() == central_coord  # not the site's own coordinator's
    assert "dev-1" not in read_key_registry(registry_path(central))[1]
    with pytest.raises(BrokerConfigError, match="no key for dev-2"):
        add_gateway(central, "site-a", ["dev-1", "dev-2"], device_keys=registry_path(site))
    from mqtt_broker.bridge import read_gateways

    assert read_gateways(central) == {"site-a": ["dev-1"]}  # refused whole: nothing changed
    add_gateway(central, "site-a", ["dev-1"], device_keys=registry_path(site))
    assert read_key_registry(registry_path(central))[1]["dev-1"] == dev.signer().public
    write_broker_files(BrokerConfig(federation="f1", port=1883), central)  # a restart keeps the site's keys
    assert read_key_registry(registry_path(central))[1]["dev-1"] == dev.signer().public
    write_broker_files(site_cfg, site)
    assert load_credentials(site, "dev-1").coordinator() == central_coord
