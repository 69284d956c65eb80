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
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attacklib_secagg import coordinator_round, send_masked, spoil_shares, to_shares, unmask_all

from flayer.secagg import RingSpec, SecAggClient, SecAggParams, run_round
from flayer.secagg.ring import decode_sum, encode

IDS = tuple(f"dev-{i:02d}" for i in range(8))


def _params() -> SecAggParams:
    return SecAggParams("fed.1.ab", 1, IDS, 4, 6, bytes(32), 16, RingSpec.for_summands(1.0, len(IDS)))


def _vectors(p: SecAggParams) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    floats = {d: rng.uniform(-0.5, 0.5, p.length) for d in IDS}
    return floats, {d: encode(floats[d], p.ring, None) for d in IDS}  # nearest rounding: nothing to hide here


def _spoil_one_share(monkeypatch: pytest.MonkeyPatch, sender: str, victim: str | None) -> None:
    """``sender`` seals for ``victim`` (None: its first neighbour of each round, by id) what is no share at its x
    (attacklib_secagg.spoil_shares)."""
    spoil_shares(monkeypatch, sender, lambda c: {victim if victim is not None else min(c._peers, default="")})


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


def test_a_spoiled_share_does_not_let_quorum_and_grace_close_on_inputs_that_cannot_be_unmasked(monkeypatch):
    """Five devices (t = 3): evil spoils dev-0's share of its secrets and masks first; when quorum and grace end the
    stage on four masked inputs (dev-1's still coming), only dev-2 and dev-3 could reveal shares of b_evil. The
    coordinator must hold the stage for dev-1 (before: it asked for consents and the round was abandoned at the
    unmasking, "2 shares of b_evil arrived, fewer than t=3"), then unmask the sum."""
    names = ("dev-0", "dev-1", "dev-2", "dev-3", "evil")
    _spoil_one_share(monkeypatch, "evil", "dev-0")
    sec, clients, ups = coordinator_round(names)
    assert sec.planned.params.threshold == 3
    routed = to_shares(sec, clients)
    for d in ("evil", "dev-0", "dev-2", "dev-3"):  # evil's masked input is in before dev-0 complains of it
        assert send_masked(sec, clients, ups, routed, d) is None, d
    assert "evil" in sec.server.faulty and "does not open" in sec.server.faulty["evil"]
    held = sec.held()  # the round's timer says quorum 4 + grace: the coordinator asks the round first
    assert held is not None and "_evil" in held, held  # b_evil, or s_evil where a named device is taken out
    assert sec.advance(102.0) == [] and sec.stage == 3  # not ended: dev-1 can complete it
    assert send_masked(sec, clients, ups, routed, "dev-1") is None
    assert sec.held() is None
    out = unmask_all(sec, clients, silent={"evil"})  # named faulty, it signed nothing and answers nothing
    assert out.reason is None and out.update is not None, out.reason


def test_a_round_no_survivor_set_can_unmask_ends_before_any_device_books_it(monkeypatch):
    """Four devices (t = 3): evil spoils dev-0's share and is named before its masked input, which is refused; once
    dev-1's masked input is in without a complaint, only dev-1 and dev-2 can hold shares of s_evil whatever else
    comes. The round must end then, before quorum and the consent stage (a consent books the round in the device's
    ledger); before, it waited for its deadline, asked the three honest devices to consent, and was abandoned at the
    unmasking."""
    names = ("dev-0", "dev-1", "dev-2", "evil")
    _spoil_one_share(monkeypatch, "evil", "dev-0")
    sec, clients, ups = coordinator_round(names)
    routed = to_shares(sec, clients)
    assert send_masked(sec, clients, ups, routed, "dev-0") is None
    refused = send_masked(sec, clients, ups, routed, "evil")
    assert refused is not None and "named faulty" in refused
    from flayer.secagg import SecAggAbandoned

    # dev-1 and dev-2 may yet complain of evil too (had evil spoiled theirs, their pair seeds would unmask the round:
    # test_attack_secagg_garbage_outlook.py); once dev-1's masked input comes without a complaint, it holds a share
    # of s_evil and only dev-2 can join it
    assert sec.advance(102.0) == [] and sec.stage == 3
    assert send_masked(sec, clients, ups, routed, "dev-1") is None
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
        # and a grace of 20 s after the quorum: the spoiler's victim complains, then masks, and on a loaded machine
        # it can come seconds after the quorum (with no grace the round closed without it, naming nobody)
        fed.write_text(fed.read_text().replace("secure_stage_s = 4.0", "secure_stage_s = 10.0")
                       .replace("min_devices = 4", "min_devices = 5").replace("grace_s = 0.0", "grace_s = 20.0"))
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        finished(coord, thread, TIMEOUT + 20 * max(0, ROUNDS - 3) - 120, rounds=ROUNDS)
        _check(tmp_path, "evil", "does not open", names[:-1])
    finally:
        for dev in devices:
            dev.stop()
