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


def _spoil_one_share(monkeypatch: pytest.MonkeyPatch, sender: str, receiver: str) -> None:
    """``sender`` seals for ``receiver`` what is no share at its x, under the pair's genuine key (its own message: a
    ciphertext that does not authenticate would prove nothing of its sender, whoever routed it could have altered
    it, so its receiver holds nothing of the sender and complains of nothing: test_attack_redteam3_complaint_keys)."""
    real = SecAggClient.share_keys

    def share_keys(self: SecAggClient, bundle: Any) -> Any:
        out = real(self, bundle)
        if self.device != sender or receiver not in self._peers:
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

    names = [*HONEST, "evil"]
    _spoil_one_share(monkeypatch, "evil", "dev-0")  # evil's own share batch: one share spoiled
    fb = attack_fed(names[:-1], adversary=names[-1], view="device",  # the adversary: its own device account
                    kind="mosquitto" if mosquitto_available() else "embedded")
    devices: list[Any] = []
    try:
        devices = _devices(tmp_path, fb, digits, names)
        _online_first(devices)
        fed = _federation(tmp_path, fb, ROUNDS)  # stages of 10 s: one slow answer on a loaded machine must not end one
        fed.write_text(fed.read_text().replace("secure_stage_s = 4.0", "secure_stage_s = 10.0"))
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        finished(coord, thread, TIMEOUT + 20 * max(0, ROUNDS - 3) - 120, rounds=ROUNDS)
        _check(tmp_path, "evil", "does not open")
    finally:
        for dev in devices:
            dev.stop()
