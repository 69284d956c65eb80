"""A sealed share its receiver cannot open: a complaint the coordinator checks, not a lost round
(docs/explanation/secure-aggregation.md, "Faults named and left out").

The adversary is one device of a secure round. It holds its own keys and sends what it likes: here a sealed share
for one honest neighbour that opens to no share at its x (sealed under the pair's key), the rest of the protocol honest. On
the code before, that neighbour refused the whole round and nothing named the sender. Now the neighbour complains,
revealing its channel key of that pair only; the coordinator opens the ciphertext it routed and names the sender;
the round is unmasked without the sender's input when the complaint came first (its masked input is then refused
and its pairwise masks removed as a dropped device's). A device that complains falsely (of a share that opens), or
with a key that is not its own for the pair, is named itself.

The end-to-end case (a real broker and edge clients, three rounds) checks that the sender is left out of later
rounds, which are unmasked too.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flayer.secagg import RingSpec, SecAggClient, SecAggParams, keys, run_round, shamir
from flayer.secagg.client import SHARE_STAGE
from flayer.secagg.ring import decode_sum, encode
from flayer.secagg.signed_adverts import device_signs
from flayer.secagg.signed_shares import sign_share

IDS = tuple(f"dev-{i:02d}" for i in range(8))


def _params() -> SecAggParams:
    return SecAggParams("fed.1.ab", 1, IDS, 4, 6, bytes(32), 16, RingSpec.for_summands(1.0, len(IDS)))


def _vectors(p: SecAggParams) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    floats = {d: rng.uniform(-0.5, 0.5, p.length) for d in IDS}
    return floats, {d: encode(floats[d], p.ring, None) for d in IDS}  # nearest rounding: nothing to hide here


def _spoil_one_share(monkeypatch: pytest.MonkeyPatch, sender: str, victim: str | None) -> None:
    """``sender`` seals for ``victim`` (None: its first neighbour of each round, by id) what is no share at its x,
    under the pair's genuine key (its own message: a ciphertext that does not authenticate would prove nothing of
    its sender, whoever routed it could have altered it, so its receiver holds nothing of the sender and complains
    of nothing: test_attack_redteam3_complaint_keys)."""
    real = SecAggClient.share_keys

    def share_keys(self: SecAggClient, bundle: Any) -> Any:
        out = real(self, bundle)
        if self.device != sender or not self._peers:
            return out
        receiver = victim if victim is not None else min(self._peers)
        if receiver not in self._peers:
            return out
        p = self.params
        key = keys.derive_aead_key(keys.agree(self._pairs[receiver].private, self._peers[receiver].c_pk), p.session,
                                   p.round, sender, receiver)
        x = p.x_of(sender)  # a share at the sender's own x, not the receiver's
        plain = shamir.encode_share(x, 1) + shamir.encode_share(x, 2)
        sealed = keys.seal(key, plain, keys.associated_data(p.session, p.round, sender, receiver, SHARE_STAGE,
                                                               p.transcript),
                           os.urandom)
        share = replace(next(s for s in out.shares if s.receiver == receiver), ciphertext=sealed, signature=b"")
        signs = device_signs(self._consistency)  # it signs what it sends, as every sender of the round
        if signs is not None:
            share = sign_share(p, share, self._pairs[receiver].public, self._peers[receiver].c_pk, signs[0])
        spoiled = tuple(share if s.receiver == receiver else s for s in out.shares)
        return replace(out, shares=spoiled)

    monkeypatch.setattr(SecAggClient, "share_keys", share_keys)


def test_an_undecryptable_share_names_its_sender_and_the_round_is_unmasked(monkeypatch):
    p = _params()
    floats, vectors = _vectors(p)
    evil, victim = IDS[0], max(p.neighbours(IDS[0]))  # evil masks before the victim complains
    _spoil_one_share(monkeypatch, evil, victim)
    out = run_round(p, vectors, seed=b"r")
    assert out.abandoned_reason is None, out.abandoned_reason
    assert victim not in out.refusals, out.refusals[victim]
    assert set(out.faulty) == {evil} and "does not open" in out.faulty[evil]
    assert victim in out.survivors
    total = sum(floats[d] for d in out.survivors)
    assert out.sum is not None and np.abs(out.sum - total).max() < len(out.survivors) / p.ring.scale


def test_a_sender_named_before_its_masked_input_is_left_out_of_the_sum(monkeypatch):
    p = _params()
    floats, vectors = _vectors(p)
    evil, victim = IDS[-1], min(p.neighbours(IDS[-1]))  # the victim complains before evil masks
    _spoil_one_share(monkeypatch, evil, victim)
    out = run_round(p, vectors, seed=b"r")
    assert out.abandoned_reason is None, out.abandoned_reason
    assert set(out.faulty) == {evil} and evil not in out.survivors and evil in out.dropped
    assert out.sum is not None
    assert np.abs(out.sum - sum(floats[d] for d in out.survivors)).max() < len(out.survivors) / p.ring.scale


def test_a_false_complaint_names_the_complainer(monkeypatch):
    p = _params()
    floats, vectors = _vectors(p)
    liar = IDS[3]
    accused = min(p.neighbours(liar))
    real = SecAggClient._shares_in

    def lying_open(self: SecAggClient, sender: str, plain: bytes) -> Any:  # the liar's own judgement
        if self.device == liar and sender == accused:
            return None  # "it held no share at my x" -- it did
        return real(self, sender, plain)

    monkeypatch.setattr(SecAggClient, "_shares_in", lying_open)
    out = run_round(p, vectors, seed=b"r")
    assert set(out.faulty) == {liar} and "false complaint" in out.faulty[liar]
    assert out.abandoned_reason is None and accused in out.survivors and liar not in out.survivors
    assert np.abs(out.sum - sum(floats[d] for d in out.survivors)).max() < len(out.survivors) / p.ring.scale


def test_a_complaint_with_another_key_names_the_complainer(monkeypatch):
    p = _params()
    _, vectors = _vectors(p)
    liar = IDS[3]
    accused = sorted(p.neighbours(liar))[1]
    real = SecAggClient.complaints

    def framing(self: SecAggClient) -> Any:  # a key of its choosing, to make the share look unopenable
        if self.device != liar:
            return real(self)
        from flayer.secagg import ShareComplaint

        return (ShareComplaint(p.round, liar, accused, bytes(range(32))),)

    monkeypatch.setattr(SecAggClient, "complaints", framing)
    out = run_round(p, vectors, seed=b"r")
    assert set(out.faulty) == {liar} and "not its own" in out.faulty[liar]
    assert out.abandoned_reason is None and accused in out.survivors
    assert decode_sum(out.ring_sum, p.ring, len(out.survivors)) is not None


def _coordinator_round(names: tuple[str, ...]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The coordinator's protocol state of a secure round over ``names`` (coordinator.secure_round, its stage logic
    without a broker), each device's client and update; stage limits of 5 s from t = 100."""
    from coordinator.secure_round import SecureRound
    from flayer.engine.secure import PlannedSecure, round_params
    from flayer.engine.secure_layout import layout_of
    from flayer.privacy_config import PrivacySettings
    from flayer.secagg import LocalIdentities, SeededEntropy
    from flayer.update import TensorDelta, Update

    ups = {d: Update({"w": TensorDelta((8,), np.random.default_rng(i).normal(0, 0.01, 3).astype(np.float32),
                                       np.array([1, 4, 6]))}, 10) for i, d in enumerate(names)}
    lay = layout_of(ups[names[0]])
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, names, lay, 0)
    ids = LocalIdentities(names, SeededEntropy(bytes(32)))
    sec = SecureRound(PlannedSecure(params, lay.digest, False, 5.0), lay, stage_end=105.0, verify=ids.verify)
    return sec, {d: SecAggClient(params, d, consistency=ids.for_device(d)) for d in names}, ups


def _to_shares(sec: Any, clients: dict[str, Any]) -> dict[str, Any]:
    """Every device advertises and shares; the share batches each is routed."""
    from flayer.secagg import decode_message

    for d, c in clients.items():
        assert sec.receive(d, c.advertise().to_bytes()) is None
    bundles = {d: decode_message(b) for d, b in sec.advance(101.0)}
    for d, c in clients.items():
        assert sec.receive(d, c.share_keys(bundles[d]).to_bytes()) is None
    return {d: decode_message(b) for d, b in sec.advance(101.0)}


def _mask(sec: Any, clients: dict[str, Any], ups: dict[str, Any], routed: dict[str, Any], device: str) -> str | None:
    """``device`` opens its shares, sends its complaints (before its masked input, as an edge client does), then its
    masked input; the coordinator's answer to the masked input."""
    from flayer.engine.secure import device_vector

    c = clients[device]
    masked = c.masked_input(routed[device], device_vector(ups[device], sec.layout, sec.planned.params,
                                                          np.random.default_rng(0)))
    for complaint in c.complaints():
        sec.receive(device, complaint.to_bytes())
    return sec.masked(device, masked.to_bytes())


def test_a_spoiled_share_does_not_let_quorum_and_grace_close_on_inputs_that_cannot_be_unmasked(monkeypatch):
    """Five devices (t = 3): evil spoils dev-0's share of its secrets and masks first; when quorum and grace end the
    stage on four masked inputs (dev-1's still coming), only dev-2 and dev-3 could reveal shares of b_evil. The
    coordinator must hold the stage for dev-1 (before: it asked for consents and the round was abandoned at the
    unmasking, "2 shares of b_evil arrived, fewer than t=3"), then unmask the sum."""
    from flayer.secagg import decode_message

    names = ("dev-0", "dev-1", "dev-2", "dev-3", "evil")
    _spoil_one_share(monkeypatch, "evil", "dev-0")
    sec, clients, ups = _coordinator_round(names)
    assert sec.planned.params.threshold == 3
    routed = _to_shares(sec, clients)
    for d in ("evil", "dev-0", "dev-2", "dev-3"):  # evil's masked input is in before dev-0 complains of it
        assert _mask(sec, clients, ups, routed, d) is None, d
    assert "evil" in sec.server.faulty and "does not open" in sec.server.faulty["evil"]
    held = sec.held()  # the round's timer says quorum 4 + grace: the coordinator asks the round first
    assert held is not None and "b_evil" in held, held
    assert sec.advance(102.0) == [] and sec.stage == 3  # not ended: dev-1 can complete it
    assert _mask(sec, clients, ups, routed, "dev-1") is None
    assert sec.held() is None
    asks = {d: decode_message(b) for d, b in sec.advance(103.0, masked_done=True)}
    for d, ask in asks.items():
        assert sec.receive(d, clients[d].consent(ask).to_bytes()) is None
    sets = {d: decode_message(b) for d, b in sec.advance(103.0)}
    for d, shown in sets.items():
        assert sec.receive(d, clients[d].sign_survivors(shown).to_bytes()) is None
    requests = {d: decode_message(b) for d, b in sec.advance(103.0)}
    for d, request in requests.items():
        if d != "evil":  # named faulty, it signed nothing and answers nothing
            assert sec.receive(d, clients[d].unmask(request).to_bytes()) is None
    out = sec.finish()
    assert out.reason is None and out.update is not None, out.reason


def test_a_round_no_survivor_set_can_unmask_ends_before_any_device_books_it(monkeypatch):
    """Four devices (t = 3): evil spoils dev-0's share and is named before its masked input, which is refused; only
    dev-1 and dev-2 hold shares of s_evil whatever else comes. The round must end at once, before the consent stage
    (a consent books the round in the device's ledger); before, it waited for its deadline, asked the three honest
    devices to consent, and was abandoned at the unmasking."""
    names = ("dev-0", "dev-1", "dev-2", "evil")
    _spoil_one_share(monkeypatch, "evil", "dev-0")
    sec, clients, ups = _coordinator_round(names)
    routed = _to_shares(sec, clients)
    assert _mask(sec, clients, ups, routed, "dev-0") is None
    refused = _mask(sec, clients, ups, routed, "evil")
    assert refused is not None and "named faulty" in refused
    from flayer.secagg import SecAggAbandoned

    with pytest.raises(SecAggAbandoned, match="s_evil"):
        sec.advance(102.0)  # the coordinator's tick in the masked inputs' stage, before quorum
    assert sec.stage == 3 and not sec.server.consented


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(400 + 60 * max(0, int(os.environ.get("FLAYER_ATTACK_ROUNDS", "3")) - 3))
def test_an_undecryptable_share_over_the_broker_names_and_leaves_out_its_sender(tmp_path: Path, digits: Any,
                                                                                 attack_fed: Any,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
    from fedtestlib import finished
    from test_attack_secagg_attribution import (
        HONEST,
        ROUNDS,
        TIMEOUT,
        _check,
        _devices,
        _federation,
        _online_first,
    )

    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from mqtt_broker import mosquitto_available

    # five honest devices and at least five online before round 1 (min_devices): each round that selects evil has
    # five devices (t = 3), so the three honest ones besides its victim hold what unmasks the sum without it
    names = [*HONEST, "dev-4", "evil"]
    _spoil_one_share(monkeypatch, "evil", None)  # evil's own share batch: its first neighbour's share spoiled
    fb = attack_fed(names[:-1], adversary=names[-1], view="device",  # the adversary: its own device account
                    kind="mosquitto" if mosquitto_available() else "embedded")
    devices: list[Any] = []
    try:
        devices = _devices(tmp_path, fb, digits, names)
        _online_first(devices)
        fed = _federation(tmp_path, fb, ROUNDS)  # stages of 10 s: one slow answer on a loaded machine must not end one
        fed.write_text(fed.read_text().replace("secure_stage_s = 4.0", "secure_stage_s = 10.0")
                       .replace("min_devices = 4", "min_devices = 5"))
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        finished(coord, thread, TIMEOUT + 20 * max(0, ROUNDS - 3) - 120, rounds=ROUNDS)
        _check(tmp_path, "evil", "does not open", names[:-1])
    finally:
        for dev in devices:
            dev.stop()
