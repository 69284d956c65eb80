"""The coordinator's secure-round stages (coordinator.secure_round) without a broker: every stage's message
in its stage only, from its own sender; stage ends by completion or time; abandonment below t; the sum."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.secure_round import SecureRound
from flayer.engine.secure import PlannedSecure, device_vector, round_params
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import LocalIdentities, SecAggClient, SeededEntropy, decode_message
from flayer.update import TensorDelta, Update

IDS = ("a", "b", "c", "d")


def _update(seed: int) -> Update:
    rng = np.random.default_rng(seed)
    return Update({"w": TensorDelta((8,), rng.normal(0, 0.01, 3).astype(np.float32), np.array([1, 4, 6]))}, 10)


def _round(stage_s: float = 5.0) -> tuple[SecureRound, dict[str, SecAggClient], dict[str, Update]]:
    ups = {d: _update(i) for i, d in enumerate(IDS)}
    lay = layout_of(ups["a"])
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, IDS, lay, 0)
    ids = LocalIdentities(IDS, SeededEntropy(bytes(32)))  # the devices' long-term keys (the consistency round)
    sec = SecureRound(PlannedSecure(params, lay.digest, False, stage_s), lay, stage_end=100.0 + stage_s,
                      verify=ids.verify)
    return sec, {d: SecAggClient(params, d, consistency=ids.for_device(d)) for d in IDS}, ups


def _deliver(out: list[tuple[str, bytes]]) -> dict[str, object]:
    return {d: decode_message(b) for d, b in out}


def _to_masked(sec: SecureRound, clients: dict[str, SecAggClient], ups: dict[str, Update]) -> dict[str, bytes]:
    """Every device of IDS advertises, shares and sends its masked input (each taken); the masked inputs sent."""
    for d in IDS:
        sec.receive(d, clients[d].advertise().to_bytes())
    bundles = _deliver(sec.advance(101.0))
    for d in IDS:
        sec.receive(d, clients[d].share_keys(bundles[d]).to_bytes())
    shares = _deliver(sec.advance(101.0))
    blobs = {}
    for d in IDS:
        vector = device_vector(ups[d], sec.layout, sec.planned.params, np.random.default_rng(0))
        blobs[d] = clients[d].masked_input(shares[d], vector).to_bytes()
        assert sec.masked(d, blobs[d]) is None
    return blobs


def _journaled_round(tmp_path):  # type: ignore[no-untyped-def]
    """A round of IDS through its masked inputs, each journaled (as OpenRound.accept journals each accepted update)
    and read back from the journal by the round; its SecureRound, clients, updates, journal and open round."""
    import types

    from coordinator.journal import Journal
    from coordinator.secure_phase import journaled_masked

    sec, clients, ups = _round()
    journal = Journal(tmp_path, 1)
    rnd = types.SimpleNamespace(journal=journal, journal_dir=tmp_path, number=1)
    sec.recall = lambda devices: journaled_masked(rnd, devices)
    sec.server = sec._new_server()
    for d, blob in _to_masked(sec, clients, ups).items():
        journal.append_update(d, 1, blob)
    return sec, clients, ups, journal, rnd


def test_a_whole_round_gives_the_sum_and_each_stage_takes_only_its_message():
    sec, clients, ups = _round()
    advert_a = clients["a"].advertise().to_bytes()
    assert sec.receive("a", advert_a) is None
    assert "stage 1" in (sec.masked("a", b"x") or "")  # no masked input before the shares
    forged = SecAggClient(sec.planned.params, "b").advertise().to_bytes()
    assert "naming 'b', sent by 'c'" in (sec.receive("c", forged) or "")
    assert "malformed" in (sec.receive("c", b"garbage") or "")
    for d in IDS[1:]:
        assert sec.receive(d, clients[d].advertise().to_bytes()) is None
    bundles = _deliver(sec.advance(101.0))  # every selected device advertised: stage 1 ends at once
    assert sec.stage == 2 and set(bundles) == set(IDS)
    assert "KeyAdvert in stage 2" in (sec.receive("a", advert_a) or "")
    for d in IDS:
        assert sec.receive(d, clients[d].share_keys(bundles[d]).to_bytes()) is None
    shares = _deliver(sec.advance(101.0))
    assert sec.stage == 3
    lay, params = sec.layout, sec.planned.params
    blobs = {d: clients[d].masked_input(shares[d], device_vector(ups[d], lay, params, np.random.default_rng(0)))
             .to_bytes() for d in IDS}
    assert "masked input" in (sec.masked("a", blobs["b"]) or "")  # b's, sent in a's name: refused
    for d in ("a", "c", "d"):
        assert sec.masked(d, blobs[d]) is None
    assert sec.masked("a", blobs["a"]) is not None  # a second one
    asks = _deliver(sec.advance(102.0, masked_done=True))  # each device whose masked input arrived: its consent
    assert sec.stage == 4 and set(asks) == {"a", "c", "d"}
    consent_a = clients["a"].consent(asks["a"]).to_bytes()
    assert "does not verify" in (sec.receive("c", consent_a.replace(b"\x01a", b"\x01c", 1)) or "")  # a's, as c's
    for d in ("a", "c"):
        assert sec.receive(d, clients[d].consent(asks[d]).to_bytes()) is None
    assert sec.advance(102.0) == [] and sec.stage == 4  # d's consent is awaited
    assert sec.receive("d", clients["d"].consent(asks["d"]).to_bytes()) is None
    sets = _deliver(sec.advance(102.0))
    # every participant is asked to sign, b too (a witness: its masked input came late)
    assert sec.stage == 5 and set(sets) == set(IDS) and all(m.survivors == ("a", "c", "d") for m in sets.values())
    signature_c = clients["c"].sign_survivors(sets["c"]).to_bytes()
    assert "does not verify" in (sec.receive("a", signature_c.replace(b"\x01c", b"\x01a", 1)) or "")  # c's, as a's
    for d in ("a", "d"):
        assert sec.receive(d, clients[d].sign_survivors(sets[d]).to_bytes()) is None
    assert sec.receive("b", clients["b"].sign_survivors(sets["b"]).to_bytes()) is None  # a witness
    assert clients["b"].left_out  # it vouched for a set without itself: its input is in no sum
    assert sec.advance(102.0) == [] and sec.stage == 5  # T = 3 signed, but survivor c's own signature is awaited
    assert sec.receive("c", signature_c) is None
    requests = _deliver(sec.advance(102.0))  # every survivor signed: the unmask requests, with the signatures
    assert sec.stage == 6 and set(requests) == {"a", "c", "d"}
    assert all(dict(r.consents).keys() == {"a", "c", "d"} - {d} for d, r in requests.items())  # the others' consents
    from coordinator.intake import IntakeContext, validate
    from protocol import WireLimits

    ctx = IntakeContext("fed", 1, {1: "0" * 64}, {}, WireLimits(), 1 << 20, masked=sec.masked)
    late = validate("b", blobs["b"], ctx)  # b was slow: its masked input came after the survivors were named
    assert late.status == "late" and late.counter == "late" and "unmasking began" in late.reason
    assert not sec.unmask_done(102.0)
    for d, req in requests.items():
        assert sec.receive(d, clients[d].unmask(req).to_bytes()) is None
    assert sec.unmask_done(102.0)
    out = sec.finish()
    assert out.reason is None and out.survivors == ("a", "c", "d") and out.dropped == ("b",)
    plain = sum(ups[d].deltas["w"].values.astype(np.float64) for d in ("a", "c", "d"))
    scale = sec.planned.params.ring.scale  # stochastic rounding: each of 3 summands within 1/scale
    assert out.update is not None and np.abs(out.update.deltas["w"].values - plain).max() < 3 / scale


def test_a_stage_ends_by_its_time_and_too_few_devices_abandon_the_round():
    from flayer.secagg import SecAggAbandoned

    sec, clients, _ = _round()
    sec.receive("a", clients["a"].advertise().to_bytes())
    assert sec.advance(101.0) == [] and sec.stage == 1  # waiting for the others
    with pytest.raises(SecAggAbandoned, match="1 devices advertised keys, fewer than the 3 the unmasking needs"):
        sec.advance(106.0)  # its time is up with one advert


def test_a_stage_ends_at_once_when_too_few_devices_can_still_come():
    """Three of four advertised, then two went offline: the survivor set can no longer hold T = 3, so the round
    ends on the next tick instead of at the stage's end -- before any masked input (nothing booked)."""
    from flayer.secagg import SecAggAbandoned

    sec, clients, _ = _round(stage_s=30.0)
    off: set[str] = set()
    sec.gone = lambda d: d in off
    for d in ("a", "b", "c"):
        sec.receive(d, clients[d].advertise().to_bytes())
    off.add("d")  # d never advertised and went offline: stage 1 ends at once, without waiting 30 s
    bundles = _deliver(sec.advance(101.0))
    assert sec.stage == 2 and set(bundles) == {"a", "b", "c"}
    sec.receive("a", clients["a"].share_keys(bundles["a"]).to_bytes())
    assert sec.advance(102.0) == []  # b and c can still send their shares
    off.update({"b", "c"})
    with pytest.raises(SecAggAbandoned, match="1 devices sent their shares, fewer than the 3 the unmasking needs"):
        sec.advance(103.0)


def test_the_loop_sleeps_until_the_unmask_stage_ends_instead_of_spinning():
    """In the unmask stage the round timer's quorum + grace has passed; the coordinator's loop waits for the
    stage's end (or an event), not for a wake-up time in the past (a busy loop: ~10 CPU s a round measured
    on an emulated fleet of 100 before the fix)."""
    import types

    from coordinator.rounds import RoundTimer
    from coordinator.server import Coordinator

    sec, clients, ups = _round(stage_s=5.0)
    _to_masked(sec, clients, ups)
    for d, req in _deliver(sec.advance(102.0, masked_done=True)).items():
        sec.receive(d, clients[d].consent(req).to_bytes())
    for d, req in _deliver(sec.advance(102.0)).items():
        sec.receive(d, clients[d].sign_survivors(req).to_bytes())
    sec.advance(102.0)
    assert sec.stage == 6 and sec.stage_end == 107.0
    timer = RoundTimer(opened_at=90.0, deadline=150.0, selected=4, quorum=3, grace_s=1.0, quorum_at=100.0)
    waits: list[float] = []
    fake = types.SimpleNamespace(
        open=types.SimpleNamespace(timer=timer, secure=sec), asynchronous=False, clock=lambda: 103.0,
        inbox=types.SimpleNamespace(count_dropped=lambda n: None), events=types.SimpleNamespace(
            take_dropped=lambda: 0, get=lambda timeout: waits.append(timeout)))
    fake._wake_at = types.MethodType(Coordinator._wake_at, fake)
    Coordinator._next_event(fake)  # type: ignore[arg-type]
    assert waits == [1.0]  # the stage ends at 107: the loop sleeps its longest step, not 0 s
    sec.stage = 3  # the masked inputs' stage: the round timer decides
    Coordinator._next_event(fake)  # type: ignore[arg-type]
    assert waits[-1] == 0.0  # quorum at 100 + grace 1 s: the tick closes the stage now


def test_an_asynchronous_version_waits_for_its_deadline_not_a_past_quorum():
    """An asynchronous version closes at its buffer or its deadline; once ``quorum`` updates are in, the
    round timer's quorum + grace lies in the past and waking at it spun the loop until the buffer filled."""
    import types

    from coordinator.rounds import RoundTimer
    from coordinator.server import Coordinator

    timer = RoundTimer(opened_at=90.0, deadline=150.0, selected=10, quorum=2, grace_s=5.0, quorum_at=91.0)
    fake = types.SimpleNamespace(open=types.SimpleNamespace(timer=timer, secure=None), asynchronous=True)
    assert Coordinator._wake_at(fake, 100.0) == 150.0  # type: ignore[arg-type]
    fake.asynchronous = False
    assert Coordinator._wake_at(fake, 100.0) == 96.0  # type: ignore[arg-type]  # synchronous: quorum + grace


def test_a_masked_input_without_a_consent_is_read_back_from_the_journal_and_left_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """d sends its masked input and never consents: the coordinator keeps only the running sum, reads d's masked input
    back from the round's journal when the consent stage closes, takes it out of the sum and counts d as dropped."""
    sec, clients, ups, journal, _ = _journaled_round(tmp_path)
    assert sec.server.consent is not None and sec.server.consent._inputs is None  # only the running sum in memory
    asks = _deliver(sec.advance(102.0, masked_done=True))
    for d in ("a", "b", "c"):  # d never consents
        assert sec.receive(d, clients[d].consent(asks[d]).to_bytes()) is None
    sets = _deliver(sec.advance(108.0))  # the consent stage's time is up (opened at 102, 5 s)
    assert sec.stage == 5 and all(m.survivors == ("a", "b", "c") for m in sets.values())
    for d in IDS:
        sec.receive(d, clients[d].sign_survivors(sets[d]).to_bytes())
    requests = _deliver(sec.advance(108.0))
    assert set(requests) == {"a", "b", "c"} and all(r.dropped == ("d",) for r in requests.values())
    for d, req in requests.items():
        assert sec.receive(d, clients[d].unmask(req).to_bytes()) is None
    out = sec.finish()
    assert out.reason is None and out.survivors == ("a", "b", "c") and out.dropped == ("d",)
    plain = sum(ups[d].deltas["w"].values.astype(np.float64) for d in ("a", "b", "c"))
    assert out.update is not None and np.abs(out.update.deltas["w"].values - plain).max() < 3 / sec.planned.params.ring.scale
    journal.close()


def _withheld_round(tmp_path, journal_open: bool):  # type: ignore[no-untyped-def]
    """A round of IDS to its consent stage, every masked input journaled, d's consent withheld."""
    sec, clients, _, journal, rnd = _journaled_round(tmp_path)
    asks = _deliver(sec.advance(102.0, masked_done=True))
    for d in ("a", "b", "c"):
        assert sec.receive(d, clients[d].consent(asks[d]).to_bytes()) is None
    if not journal_open:  # the fallback: one streaming pass over the file
        journal.close()
        rnd.journal = None
    return sec, journal


@pytest.mark.parametrize("journal_open", [True, False])
def test_a_masked_input_read_back_from_a_damaged_or_foreign_record_abandons_the_round(tmp_path, journal_open):  # type: ignore[no-untyped-def]
    """The record read back must authenticate and be the device's masked input of this round; else the round is
    abandoned with the reason (never a crash, never a wrong sum)."""
    from coordinator.journal import journal_path
    from flayer.secagg import SecAggAbandoned

    sec, journal = _withheld_round(tmp_path / "ok", journal_open)
    sets = _deliver(sec.advance(108.0))  # d's input read back and taken out: the round goes on
    assert sec.stage == 5 and all(m.survivors == ("a", "b", "c") for m in sets.values())

    sec, journal = _withheld_round(tmp_path / "flip", journal_open)
    path = journal_path(tmp_path / "flip", 1)
    data = bytearray(path.read_bytes())
    data[-20] ^= 1  # a bit of d's record (the last) flips on disk
    path.write_bytes(bytes(data))
    with pytest.raises(SecAggAbandoned, match="cannot be read back: .* does not authenticate"):
        sec.advance(108.0)

    sec, journal = _withheld_round(tmp_path / "foreign", journal_open)
    c_blob = next(journal.read_updates(["c"])).data if journal_open else None
    path = journal_path(tmp_path / "foreign", 1)
    if journal_open:  # the record noted as d's holds c's masked input, under d's name
        del journal._where["d"]
        journal.append_update("d", 1, c_blob)
    else:  # d's record lost; the one in its place holds c's masked input, under d's name
        from coordinator.journal import Journal, read_journal

        c_blob = next(r.data for r in read_journal(path).updates if r.client == "c")
        data = path.read_bytes()
        path.write_bytes(data[:data.rindex(b"FLJ2")])
        again = Journal(tmp_path / "foreign", 1)
        again.append_update("d", 1, c_blob)
        again.close()
    with pytest.raises(SecAggAbandoned, match="the journal record of d in round 1 is not its masked input"):
        sec.advance(108.0)

    if not journal_open:
        sec, journal = _withheld_round(tmp_path / "lost", journal_open)
        path = journal_path(tmp_path / "lost", 1)
        data = path.read_bytes()
        path.write_bytes(data[:data.rindex(b"FLJ2")])  # d's record lost
        with pytest.raises(SecAggAbandoned, match="the masked input of d cannot be read back"):
            sec.advance(108.0)
