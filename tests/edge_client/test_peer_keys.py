"""Where a device gets the other devices' public keys (edge_client.peer_keys): the federation's registry from its
kit or the broker's state folder, re-read when it changes; never anything else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_client.peer_keys import PeerKeys
from mqtt_broker import BrokerConfig, add_device, write_broker_files
from mqtt_broker.kit import write_kit
from protocol import SignatureError, SigningKey
from protocol.signing import render_key_registry, survivor_signer, survivor_verifier
from transport.credentials import Credentials
from transport.kit import unpack_kit


def test_a_kit_carries_the_registry_and_its_device_checks_the_others_signatures(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    add_device(state, "dev-1")
    add_device(state, "dev-2")
    toml = unpack_kit(write_kit(state, "dev-1", tmp_path / "dev-1.tar.gz"))
    creds = Credentials.load(toml.parent / "credentials.toml")
    assert creds.registry == toml.parent / "signing_keys.json" and creds.registry.is_file()  # the kit's copy
    peers = PeerKeys("f1", creds.registry)
    other = Credentials.load(state / "credentials" / "dev-2.toml")
    assert other.registry == state / "signing_keys.json"  # in place, in the broker's state folder
    sig = survivor_signer(other.signer(), "f1", 3, "dev-2")(b"the set")
    verify = survivor_verifier(peers, "f1", 3)
    assert verify("dev-2", b"the set", sig)
    assert not verify("dev-2", b"another set", sig)
    assert not verify("dev-2", b"the set", survivor_signer(SigningKey.generate(), "f1", 3, "dev-2")(b"the set"))
    assert not survivor_verifier(peers, "f1", 4)("dev-2", b"the set", sig)  # another round
    assert not verify("dev-9", b"the set", sig)  # no such device in the registry


def test_the_registry_is_read_again_when_it_changes_and_a_missing_one_believes_nobody(tmp_path: Path) -> None:
    path = tmp_path / "signing_keys.json"
    peers = PeerKeys("f1", path)
    with pytest.raises(SignatureError, match="no key in the registry for 'dev-1'"):
        peers.key_for("f1", "dev-1")
    key = SigningKey.generate()
    path.write_text(render_key_registry(None, {"dev-1": key.public}))
    assert peers.key_for("f1", "dev-1") == key.public  # written since: read on the miss
    new = SigningKey.generate()
    path.write_text(render_key_registry(None, {"dev-1": new.public, "dev-2": key.public}))
    os.utime(path, (1, 1))  # a modification time of its own
    assert peers.key_for("f1", "dev-2") == key.public
    with pytest.raises(SignatureError, match="not 'f1'"):
        peers.key_for("f2", "dev-1")
    path.write_text("not json")
    os.utime(path, (2, 2))
    with pytest.raises(SignatureError, match="dev-3"):
        peers.key_for("f1", "dev-3")  # a miss reads the file again: malformed, refused
    assert peers.key_for("f1", "dev-2") == key.public  # ... and the last good keys are kept
    with pytest.raises(SignatureError):
        PeerKeys("f1", None).key_for("f1", "dev-1")
