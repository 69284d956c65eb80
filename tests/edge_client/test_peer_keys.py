"""Where a device gets the other devices' public keys (edge_client.peer_keys): certificates when its kit carries
one (edge_client.certified_keys), else the federation's registry in the broker's state folder, re-read when it
changes; never anything else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_client.certified_keys import CertifiedKeys, round_keys
from edge_client.peer_keys import PeerKeys, peer_keys_for
from mqtt_broker import BrokerConfig, add_device, write_broker_files
from mqtt_broker.kit import write_kit
from protocol import Plan, SignatureError, SigningKey
from protocol.signing import render_key_registry, survivor_signer, survivor_verifier
from transport.credentials import Credentials
from transport.kit import unpack_kit


def test_a_kit_device_checks_the_others_signatures_through_their_certificates(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    write_broker_files(BrokerConfig(federation="f1", port=1883), state)
    add_device(state, "dev-1")
    toml = unpack_kit(write_kit(state, "dev-1", tmp_path / "dev-1.tar.gz"))
    add_device(state, "dev-2")  # added after dev-1's kit was made
    write_kit(state, "dev-2", tmp_path / "dev-2.tar.gz")
    creds = Credentials.load(toml.parent / "credentials.toml")
    assert not (toml.parent / "signing_keys.json").exists()  # no copy of the registry in a kit
    peers = peer_keys_for(creds, tmp_path / "dev-1-state")
    assert isinstance(peers, CertifiedKeys)
    keys, own, admit = round_keys(peers)  # one secure round's
    assert own.strip() == (toml.parent / "device.cert").read_bytes().strip()  # its own, carried in its adverts
    assert admit is not None and admit("dev-2", (state / "certs/dev-2.json").read_bytes()) is None  # as its advert
    other = Credentials.load(state / "credentials" / "dev-2.toml")
    assert other.registry == state / "signing_keys.json"  # in place, in the broker's state folder
    assert isinstance(peer_keys_for(other, tmp_path / "dev-2-state"), PeerKeys)  # no kit: the registry in place
    sig = survivor_signer(other.signer(), "f1", 3, "dev-2")(b"the set")
    verify = survivor_verifier(keys, "f1", 3)
    assert verify("dev-2", b"the set", sig)
    assert not verify("dev-2", b"another set", sig)
    assert not verify("dev-2", b"the set", survivor_signer(SigningKey.generate(), "f1", 3, "dev-2")(b"the set"))
    assert not survivor_verifier(keys, "f1", 4)("dev-2", b"the set", sig)  # another round
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


def test_without_a_registry_a_device_takes_no_part_in_secure_rounds(tmp_path: Path) -> None:
    """It could check none of the keys the coordinator relays (flayer.secagg.signed_adverts): it sends no advert."""
    from types import SimpleNamespace

    import numpy as np

    from edge_client.secure import SecureRounds
    from edge_client.store import DeviceStore
    from flayer.engine.secure import plan_round, plan_secure
    from flayer.engine.secure_layout import layout_of
    from flayer.privacy_config import PrivacySettings
    from flayer.update import TensorDelta, Update

    ids = tuple(f"dev-{i}" for i in range(4))
    planned = plan_round(PrivacySettings(secure_aggregation=True), "f1.1.ab", 1, ids,
                         layout_of(Update({"w": TensorDelta((4,), np.zeros(4, np.float32))}, 1)), 7, None, 1.0)
    plan = Plan(round=1, selected=ids, deadline=0.0, strategy="fedavg", options={}, model={}, model_digest="0" * 64,
                model_chunks=1, model_size=1, secure=plan_secure(planned))
    path = tmp_path / "signing_keys.json"

    class Device(SecureRounds):
        def __init__(self) -> None:
            self.id, self.creds, self.signer = "dev-1", SimpleNamespace(federation="f1"), SigningKey.generate()
            self.peers = PeerKeys("f1", path)
            self.settings, self.stored = SimpleNamespace(secure_corrupt_fraction=0.0), SimpleNamespace(done_round=0)
            self.store = DeviceStore(tmp_path / "state")
            self._secure, self.sent = None, []

        def _budget_refuses(self, plan: object) -> bool:
            return False

        def _secure_publish(self, bodies: list[bytes], round_: int) -> None:
            self.sent.extend(bodies)

    device = Device()
    assert not device.peers.available()
    device._secure_plan(plan)
    assert device._secure is None and device.sent == []  # no advert
    path.write_text(render_key_registry(None, {d: SigningKey.generate().public for d in ids}))
    device._secure_plan(plan)
    assert device._secure is not None and len(device.sent) == 1  # with one: its advert, signed toward each neighbour
    from flayer.secagg import decode_message

    assert len(decode_message(device.sent[0]).signatures) == planned.params.degree  # type: ignore[union-attr]
