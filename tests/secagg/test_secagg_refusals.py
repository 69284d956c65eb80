"""What a device refuses (client.py): misaddressed share batches, untrustworthy bundles, and unmask requests that
ask for both secrets of one neighbour or contradict what it knows; a sealed share that is replayed, forged,
relabelled is not refused: the device masks with its sender and holds nothing of it, revealing no key (whoever
routed it could have altered it); one that opens to no share at its x is complained of (the coordinator judges)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flayer.secagg import (
    EncryptedShare,
    RingSpec,
    SecAggError,
    SecAggParams,
    SeededEntropy,
    ShareBatch,
    run_round,
)
from flayer.secagg import keys as K
from flayer.secagg.shamir import encode_share


def swap_share(batch: ShareBatch, sender: str, new: EncryptedShare) -> ShareBatch:
    return replace(batch, shares=tuple(new if s.sender == sender else s for s in batch.shares))


def shared(staged, **kwargs):
    r = staged(**kwargs)
    r.advertise()
    r.share()
    return r


def complained(client, batch, vector) -> list[str]:
    client.masked_input(batch, vector)
    return [c.accused for c in client.complaints()]


def test_a_share_replayed_from_another_round_or_session_is_held_as_nothing(staged):
    now = shared(staged, round_id=2)
    for stale in (shared(staged, round_id=1), shared(staged, round_id=2, session="fed-other")):
        # the same seeds give the same keys: only the round / session binding tells the shares apart
        assert stale.adverts["dev-00"].c_pk == now.adverts["dev-00"].c_pk
        replayed = next(s for s in stale.server.shares_for("dev-01").shares if s.sender == "dev-00")
        batch = swap_share(now.server.shares_for("dev-01"), "dev-00", replayed)
        client = now.fresh("dev-01", 2)
        assert complained(client, batch, now.vectors["dev-01"]) == []
        assert "dev-00" in client.partners and "dev-00" not in client._held
    assert complained(now.fresh("dev-01", 2), now.server.shares_for("dev-01"), now.vectors["dev-01"]) == []


def test_a_forged_share_is_held_as_nothing_and_reveals_no_key(staged):
    r = shared(staged)
    batch = r.server.shares_for("dev-02")
    target = batch.shares[0]
    for i in (0, 20, len(target.ciphertext) - 1):  # nonce, ciphertext, tag
        forged = bytearray(target.ciphertext)
        forged[i] ^= 0x80
        client = r.fresh("dev-02", 2)
        bad = swap_share(batch, target.sender, replace(target, ciphertext=bytes(forged)))
        assert complained(client, bad, r.vectors["dev-02"]) == []
        assert target.sender in client.partners and target.sender not in client._held  # masks with it, holds nothing
    assert complained(r.fresh("dev-02", 2), batch, r.vectors["dev-02"]) == []  # the genuine batch


def test_a_misaddressed_share_is_refused(staged):
    r = shared(staged)
    for_three = next(s for s in r.server.shares_for("dev-03").shares if s.sender == "dev-00")
    batch = r.server.shares_for("dev-01")
    with pytest.raises(SecAggError, match="addressed to dev-03"):
        r.fresh("dev-01", 2).masked_input(swap_share(batch, "dev-00", for_three), r.vectors["dev-01"])
    relabelled = replace(for_three, receiver="dev-01")  # another pair's key and associated data
    assert complained(r.fresh("dev-01", 2), swap_share(batch, "dev-00", relabelled), r.vectors["dev-01"]) == []
    with pytest.raises(SecAggError, match="batch is for dev-03"):
        r.fresh("dev-01", 2).masked_input(r.server.shares_for("dev-03"), r.vectors["dev-01"])


def test_shares_from_strangers_and_too_few_shares_are_refused(staged):
    r = shared(staged, count=10, degree=4, threshold=4)
    me = "dev-00"
    batch = r.server.shares_for(me)
    stranger = next(d for d in r.ids if d != me and d not in r.params.neighbours(me))
    fake = replace(batch.shares[0], sender=stranger)
    with pytest.raises(SecAggError, match="keys this device never received"):
        r.fresh(me, 2).masked_input(swap_share(batch, batch.shares[0].sender, fake), r.vectors[me])
    with pytest.raises(SecAggError, match="2 neighbours' shares opened; t=4 needs 3"):
        r.fresh(me, 2).masked_input(replace(batch, shares=batch.shares[:2]), r.vectors[me])
    with pytest.raises(ValueError, match="uint32 array of shape"):
        r.fresh(me, 2).masked_input(batch, r.vectors[me].astype(np.int64))


def test_a_device_refuses_bundles_it_cannot_trust(staged):
    r = staged(count=10, degree=4, threshold=3)
    r.advertise()
    me = "dev-00"
    bundle = r.server.key_bundle(me)
    stranger = next(d for d in r.ids if d != me and d not in r.params.neighbours(me))
    first, second = bundle.adverts[0], bundle.adverts[1]
    cases = {
        "bundle is for dev-01": replace(bundle, device="dev-01"),
        f"holds {stranger}, not a neighbour": replace(bundle, adverts=bundle.adverts + (r.adverts[stranger],)),
        "repeats a public key": replace(bundle, adverts=(first, replace(second, c_pk=first.s_pk))),
        "own key": replace(bundle, adverts=(replace(first, s_pk=r.adverts[me].s_pk), second)),
        "1 neighbours advertised; t=3 needs 2": replace(bundle, adverts=(first,)),
    }
    for reason, bad in cases.items():
        with pytest.raises(SecAggError, match=reason if reason != "own key" else "repeats a public key"):
            r.fresh(me, 1).share_keys(bad)
    r.fresh(me, 1).share_keys(bundle)


def masked(staged, **kwargs):
    r = shared(staged, **kwargs)
    r.mask()
    return r


def test_a_device_refuses_to_reveal_both_shares_of_one_neighbour(staged):
    r = masked(staged)
    request = r.server.unmask_request("dev-00")
    both = replace(request, dropped=("dev-01",))  # dev-01 also stays among the survivors
    assert "dev-01" in both.survivors
    with pytest.raises(SecAggError, match=r"asked for both shares of \['dev-01'\]"):
        r.clients["dev-00"].unmask(both)
    with pytest.raises(SecAggError, match="refused an earlier message"):
        r.clients["dev-00"].unmask(request)  # nor will it answer a corrected request afterwards


def test_a_device_answers_the_unmask_stage_once(staged):
    r = masked(staged)
    request = r.server.unmask_request("dev-00")
    answer = r.clients["dev-00"].unmask(request)
    assert {o for o, _ in answer.b_shares} == set(request.survivors) and not answer.s_shares
    with pytest.raises(SecAggError, match="out of order"):
        r.clients["dev-00"].unmask(replace(request, survivors=("dev-00",), dropped=request.survivors[1:]))


@pytest.mark.parametrize(("change", "reason"), [
    ({"survivor_count": 2}, "survivor count 2 below"),
    ({"survivors": ("dev-01", "dev-02", "dev-03", "dev-04")}, "does not list this device"),
    ({"round": 9}, "unmask request is for dev-00 in round 9"),
    ({"device": "dev-01"}, "unmask request is for dev-01"),
])
def test_a_device_refuses_requests_it_can_see_are_wrong(staged, change, reason):
    r = masked(staged)  # 5 devices, complete graph, t = 3
    with pytest.raises(SecAggError, match=reason):
        r.clients["dev-00"].unmask(replace(r.server.unmask_request("dev-00"), **change))


def test_a_device_refuses_requests_that_contradict_the_shares_it_received(staged):
    r = staged(count=10, degree=4, threshold=3)
    r.advertise()
    late = next(iter(r.params.neighbours("dev-00")))
    r.share([d for d in r.ids if d != late])  # one neighbour never shares
    r.mask()
    request = r.server.unmask_request("dev-00")
    assert late not in request.survivors + request.dropped
    with pytest.raises(SecAggError, match=f"lists \\['{late}'\\], whose shares never reached this device"):
        r.fresh("dev-00", 3).unmask(replace(request, dropped=request.dropped + (late,)))
    partner = request.survivors[1]
    with pytest.raises(SecAggError, match=f"leaves out \\['{partner}'\\], which completed stage 2"):
        r.fresh("dev-00", 3).unmask(replace(request, survivors=tuple(s for s in request.survivors if s != partner)))
    r.fresh("dev-00", 3).unmask(request)


def test_stages_run_in_order(staged):
    r = staged()
    client = r.clients["dev-00"]
    with pytest.raises(SecAggError, match="share_keys out of order"):
        client.share_keys(None)  # type: ignore  # the stage is checked first
    client.advertise()
    with pytest.raises(SecAggError, match="advertise out of order"):
        client.advertise()


def resealed(r, sender: str, receiver: str, plain: bytes) -> EncryptedShare:
    """A share ``sender`` could really have sent: sealed under the pair's key and associated data."""
    p = r.params
    key = K.derive_aead_key(K.agree(r.clients[sender]._pairs[receiver].private, r.server._pair_key(receiver, sender)),
                            p.session, p.round, sender, receiver)
    ad = K.associated_data(p.session, p.round, sender, receiver, 2, p.transcript)
    return EncryptedShare(sender, receiver, K.seal(key, plain, ad, SeededEntropy(bytes(32))))


def test_an_authentic_share_at_the_wrong_x_is_complained_of(staged):
    r = shared(staged)
    batch = r.server.shares_for("dev-01")
    genuine = resealed(r, "dev-00", "dev-01", encode_share(2, 5) * 2)  # dev-01's x is 2
    assert complained(r.fresh("dev-01", 2), swap_share(batch, "dev-00", genuine), r.vectors["dev-01"]) == []
    wrong_x = resealed(r, "dev-00", "dev-01", encode_share(3, 5) * 2)
    assert complained(r.fresh("dev-01", 2), swap_share(batch, "dev-00", wrong_x), r.vectors["dev-01"]) == ["dev-00"]
    zero_x = resealed(r, "dev-00", "dev-01", bytes(2) + encode_share(2, 5)[2:] + encode_share(2, 5))
    assert complained(r.fresh("dev-01", 2), swap_share(batch, "dev-00", zero_x), r.vectors["dev-01"]) == ["dev-00"]


def test_a_narrow_ring_refuses_values_outside_it(staged):
    r = shared(staged, bits=16)
    with pytest.raises(ValueError, match="outside Z_2\\^16"):
        r.fresh("dev-00", 2).masked_input(r.server.shares_for("dev-00"), np.full(16, 2**16, np.uint32))
    r.fresh("dev-00", 2).masked_input(r.server.shares_for("dev-00"), np.full(16, 2**16 - 1, np.uint32))


def test_a_device_that_refuses_drops_out_of_the_round():
    p = SecAggParams("fed-test", 1, tuple(f"dev-{i:02d}" for i in range(10)), 5, 4, b"g" * 32, 8,
                     RingSpec.for_summands(1.0, 10))  # t = k + 1: every neighbour must take part
    gone = "dev-00"
    out = run_round(p, {d: np.zeros(8, np.uint32) for d in p.participants}, {gone: "before_keys"}, seed=b"r")
    near = p.neighbours(gone)
    assert near <= set(out.refusals)
    assert all("3 neighbours advertised; t=5 needs 4" in out.refusals[d] for d in near)
    assert all("shares opened; t=5 needs 4" in why for d, why in out.refusals.items() if d not in near)
    assert out.abandoned_reason == "1 devices sent a masked input, fewer than t=5" and out.sum is None
