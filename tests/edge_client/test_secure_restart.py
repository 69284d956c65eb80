"""A device that restarts after its secure round's advert (edge_client.secure, edge_client.store): its keys lived in
memory, so it sits that session out instead of advertising other keys in it (which the coordinator names
equivocation, leaving the device out of every later round), and takes part in the next round."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edge_client.peer_keys import PeerKeys
from edge_client.secure import SecureRounds
from edge_client.store import DeviceStore
from flayer.engine.secure import plan_round, plan_secure
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import KeyAdvert, decode_message
from flayer.update import TensorDelta, Update
from protocol import Plan, SigningKey
from protocol.signing import render_key_registry

IDS = tuple(f"dev-{i}" for i in range(4))


def _plan(round_: int, session: str) -> Plan:
    layout = layout_of(Update({"w": TensorDelta((4,), np.zeros(4, np.float32))}, 1))
    planned = plan_round(PrivacySettings(secure_aggregation=True), session, round_, IDS, layout, 7, None, 1.0)
    return Plan(round=round_, selected=IDS, deadline=0.0, strategy="fedavg", options={}, model={},
                model_digest="0" * 64, model_chunks=1, model_size=1, secure=plan_secure(planned))


class Device(SecureRounds):
    """The edge client's secure-round path over a real state folder; what it publishes is kept."""

    def __init__(self, state_dir: Path, registry: Path, key: SigningKey) -> None:
        self.id, self.creds, self.signer = "dev-1", SimpleNamespace(federation="f1"), key
        self.peers = PeerKeys("f1", registry)
        self.store = DeviceStore(state_dir)
        self.settings, self.stored = SimpleNamespace(secure_corrupt_fraction=0.0), self.store.load()
        self._secure, self.sent = None, []

    def _budget_refuses(self, plan: object) -> bool:
        return False

    def _secure_publish(self, bodies: list[bytes], round_: int) -> None:
        self.sent.extend(bodies)


@pytest.fixture()
def registry(tmp_path: Path) -> Path:
    path = tmp_path / "signing_keys.json"
    path.write_text(render_key_registry(None, {d: SigningKey.generate().public for d in IDS}))
    return path


def test_a_device_restarted_after_its_advert_sits_the_session_out_and_takes_the_next_round(
        tmp_path: Path, registry: Path, caplog: pytest.LogCaptureFixture) -> None:
    key, state = SigningKey.generate(), tmp_path / "state"
    round1 = _plan(1, "f1.1.aa")
    before = Device(state, registry, key)
    before._secure_plan(round1)
    assert len(before.sent) == 1 and isinstance(decode_message(before.sent[0]), KeyAdvert)
    before._secure_plan(round1)  # the plan again (re-published): the same session, nothing more
    assert len(before.sent) == 1

    after = Device(state, registry, key)  # restarted: the same state folder, no keys in memory
    with caplog.at_level(logging.WARNING, logger="edge_client.client"):
        after._secure_plan(round1)  # the retained plan, read again after the restart
        after._secure_plan(round1)
    assert after.sent == [] and after._secure is None  # no second advert in the session it advertised in
    said = [r for r in caplog.records if "before it restarted" in r.getMessage()]
    assert len(said) == 1 and "sits the round out" in said[0].getMessage()  # logged once

    after._secure_plan(_plan(2, "f1.2.bb"))  # the next round: it takes part
    assert len(after.sent) == 1 and isinstance(decode_message(after.sent[0]), KeyAdvert)
    assert after._secure is not None and after._secure.round == 2


def test_a_round_opened_again_under_a_new_session_is_advertised_in(tmp_path: Path, registry: Path) -> None:
    """The coordinator re-opened round 1 under another session (its restart): new keys are no equivocation."""
    key, state = SigningKey.generate(), tmp_path / "state"
    Device(state, registry, key)._secure_plan(_plan(1, "f1.1.aa"))
    again = Device(state, registry, key)
    again._secure_plan(_plan(1, "f1.1.cc"))
    assert len(again.sent) == 1 and again._secure is not None and again._secure.session == "f1.1.cc"


def test_the_record_is_on_disk_before_the_advert_leaves_and_a_bad_one_sits_the_round_out(
        tmp_path: Path, registry: Path) -> None:
    key, state = SigningKey.generate(), tmp_path / "state"
    dev = Device(state, registry, key)
    seen: list[object] = []
    dev._secure_publish = lambda bodies, r: seen.append(DeviceStore(state).secure_advert())  # type: ignore[method-assign]
    dev._secure_plan(_plan(3, "f1.3.dd"))
    assert seen == [(3, "f1.3.dd")]  # read back from the folder at the moment the advert is published

    (state / "secure_advert").write_text("{not json")  # a torn or foreign record: which session is unknown
    bad = Device(state, registry, key)
    bad._secure_plan(_plan(3, "f1.3.dd"))
    assert bad.sent == [] and bad._secure is None  # it cannot tell whether it advertised in this session
    assert DeviceStore(state).secure_advert() == (3, "f1.3.dd")  # recorded as sat out, also across another restart
    again = Device(state, registry, key)
    again._secure_plan(_plan(3, "f1.3.dd"))
    assert again.sent == []
    bad._secure_plan(_plan(4, "f1.4.ee"))  # the next round: it takes part
    assert len(bad.sent) == 1 and DeviceStore(state).secure_advert() == (4, "f1.4.ee")
    (state / "secure_advert").write_text('{"round": 4}')  # readable, but not a round and a session
    with pytest.raises(Exception, match="not a round and a session"):
        DeviceStore(state).secure_advert()
