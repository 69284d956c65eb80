"""A hostile device that seals every neighbour a share that does not open must not get an honest secure round ended
at once (docs/explanation/guarantees.md: "A device that seals its neighbours shares that do not authenticate is named
and left out of later rounds ... Its round goes on: its neighbours remove its pairwise masks with their own pair
seeds"; docs/explanation/secure-aggregation.md, "The shares each device could reveal": a round ends at once only when
"every reachable survivor set falls short").

The adversary is one selected device: its own keys, its own envelope. It advertises honestly, then seals EVERY
neighbour a share that opens to no share at the receiver's x (under the pair's genuine key, signed), and sends no
masked input. Each honest neighbour complains (before its masked input, as an edge client does); the coordinator
names the dealer faulty. The protocol can still unmask: every surviving neighbour holds nothing of the dealer, so it
reveals its own pair's mask seed toward it (flayer.secagg.client.unmask, ``pair_seeds``) and the server removes the
dealer's pairwise masks with them (SecAggServer.result, ``by_seeds``). Found by a red team on the first version of
the coordinator's outlook (flayer.secagg.outlook), which counted only holders of s_dealer's shares: it ended the
honest round at once ("0 of the 4 devices that would answer hold a share of s_evil ... ended at once"), and over the
broker as soon as fewer than t honest devices were left that had not complained yet, so every round the dealer was
selected in was lost (tests/attacks/test_attack_secagg_booking.py, slow, failed too). Now a device out of the sum
whose every answering neighbour complained of it, or may still (its masked input not in yet), is not short.
"""
from __future__ import annotations

import pytest
from attacklib_secagg import coordinator_round, send_masked, spoil_shares, to_shares, unmask_all


def test_a_dealer_spoiling_every_share_does_not_end_an_unmaskable_round(monkeypatch: pytest.MonkeyPatch) -> None:
    from flayer.secagg import SecAggAbandoned

    names = ("dev-0", "dev-1", "dev-2", "dev-3", "evil")
    spoil_shares(monkeypatch, "evil", lambda c: set(c._peers))
    sec, clients, ups = coordinator_round(names)
    p = sec.planned.params
    assert p.neighbours("evil") >= {"dev-0", "dev-1", "dev-2", "dev-3"}
    routed = to_shares(sec, clients)
    for d in ("dev-0", "dev-1", "dev-2", "dev-3"):  # complaints first, then the masked input (as an edge client)
        assert send_masked(sec, clients, ups, routed, d) is None, d
        try:  # the coordinator's tick between arrivals (quorum not reached): the others' complaints still to come
            assert sec.advance(102.0) == [] and sec.stage == 3
        except SecAggAbandoned as exc:
            pytest.fail(f"after {d}'s masked input, an honest round that can be unmasked was ended at once: {exc}")
    assert set(sec.server.faulty) == {"evil"}
    # evil sends no masked input (it would be refused anyway: named faulty); quorum and grace end the stage
    try:
        out = unmask_all(sec, clients)
    except SecAggAbandoned as exc:
        pytest.fail(f"an honest round that can be unmasked (4 honest survivors, t={p.threshold}, each holding its "
                    f"pair seed toward the named dealer) was ended at once: {exc}")
    assert out.reason is None and out.update is not None, out.reason
