"""What the coordinator refuses (server.py), and that it never holds or rebuilds one device's input."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flayer.secagg import MaskedInput, SecAggAbandoned, SecAggError
from flayer.secagg.shamir import PRIME, decode_share, encode_share, lagrange_at_zero


def run_to_unmask(staged, drop: str | None = None, **kwargs):
    r = staged(**kwargs)
    r.advertise()
    r.share()
    r.mask([d for d in r.ids if d != drop])
    return r


def test_the_server_rebuilds_b_for_survivors_and_s_for_the_dropped_never_both(staged):
    r = run_to_unmask(staged, drop="dev-03", count=6)
    r.unmask()
    total = r.server.result()
    survivors = set(r.ids) - {"dev-03"}
    assert np.array_equal(total, r.plain_sum(survivors))
    assert r.server.reconstructed == {**{u: {"b"} for u in survivors}, "dev-03": {"s"}}
    assert not any(kinds >= {"b", "s"} for kinds in r.server.reconstructed.values())
    with pytest.raises(SecAggError, match="refusing to rebuild s_dev-00: its other secret was rebuilt"):
        r.server._reconstruct("dev-00", "s")
    with pytest.raises(SecAggError, match="refusing to rebuild b_dev-03"):
        r.server._reconstruct("dev-03", "b")
    assert np.array_equal(r.server.result(), total)  # asked again: the same sum


def test_the_server_keeps_only_the_running_sum_of_the_masked_inputs(staged):
    r = run_to_unmask(staged)
    arrays = {name: value for name, value in vars(r.server).items() if isinstance(value, np.ndarray)}
    assert list(arrays) == ["_sum"]
    for d in r.ids:  # no stored array is one device's masked or plain input
        assert not np.array_equal(arrays["_sum"], r.vectors[d])
    r.unmask()
    r.server.result()
    assert r.server._shares == {"b": {}, "s": {}}  # the shares are dropped once the sum is out


def test_the_server_refuses_a_share_it_did_not_ask_for(staged):
    r = run_to_unmask(staged, drop="dev-03", count=6)
    request = r.server.unmask_request("dev-00")
    answer = r.clients["dev-00"].unmask(request)
    s_of_survivor = replace(answer, b_shares=answer.b_shares[:1] + answer.b_shares[2:],
                            s_shares=answer.s_shares + (answer.b_shares[1],))
    with pytest.raises(SecAggError, match=f"share of s_{answer.b_shares[1][0]}, which was not asked for"):
        r.server.receive_unmask(s_of_survivor)
    b_of_dropped = replace(answer, b_shares=answer.b_shares + answer.s_shares, s_shares=())
    with pytest.raises(SecAggError, match="share of b_dev-03, which was not asked for"):
        r.server.receive_unmask(b_of_dropped)
    x, y = decode_share(answer.b_shares[0][1])
    moved = replace(answer, b_shares=((answer.b_shares[0][0], encode_share(x + 1, y)),) + answer.b_shares[1:])
    with pytest.raises(SecAggError, match="at x=2, not 1"):
        r.server.receive_unmask(moved)
    r.server.receive_unmask(answer)
    with pytest.raises(SecAggError, match="second unmask answer from dev-00"):
        r.server.receive_unmask(answer)
    with pytest.raises(SecAggError, match="not expected at this stage"):
        r.server.receive_unmask(replace(answer, device="dev-03"))


def test_a_forged_share_of_a_dropped_key_is_caught_by_its_public_key_and_skipped(staged):
    r = run_to_unmask(staged, drop="dev-03", count=7)  # t = 4, six holders of s_dev-03 answer: one false share
    # among them is off the polynomial the others give (with only t + 1, a false share among the t combined first
    # could move the key by bits X25519 clamps away and leave an honest share off: nobody is named then)
    answers = {d: r.clients[d].unmask(r.server.unmask_request(d)) for d in sorted(r.server.survivors)}
    used = sorted(r.params.x_of(d) for d in answers)[: r.params.threshold]
    liar = r.params.participants[used[0] - 1]
    x, y = decode_share(answers[liar].s_shares[0][1])
    y = (y + pow(lagrange_at_zero(used)[x], -1, PRIME)) % PRIME  # the rebuilt key becomes s + 1: still 32 bytes
    answers[liar] = replace(answers[liar], s_shares=(("dev-03", encode_share(x, y)),))
    for answer in answers.values():
        r.server.receive_unmask(answer)
    total = r.server.result()  # another four shares rebuild the key dev-03 advertised
    expect = np.sum(np.stack([r.vectors[d] for d in r.server.survivors]), axis=0, dtype=np.uint32)
    assert np.array_equal(total, expect)
    assert not r.server.faulty  # the holder may have lied or dev-03 sealed it that share: nobody is named


def test_the_server_abandons_a_round_whose_survivors_are_split(staged):
    r = staged(count=12, degree=2, threshold=2)
    r.advertise()
    r.share()
    order = ["dev-00", min(r.params.neighbours("dev-00"))]  # walk the ring (k = 2: a cycle)
    while len(order) < len(r.ids):
        order.append(next(iter(r.params.neighbours(order[-1]) - {order[-2]})))
    a, b = order[0], order[3]  # cuts the ring into arcs of 2 and 8 devices, each device keeping a neighbour
    r.mask([d for d in r.ids if d not in (a, b)])
    with pytest.raises(SecAggAbandoned, match="split"):
        r.server.unmask_request("dev-05")


def test_the_server_checks_round_sender_stage_and_size(staged):
    r = staged(count=5)
    advert = r.clients["dev-00"].advertise()
    with pytest.raises(SecAggError, match="for round 2, not 1"):
        r.server.receive_advert(replace(advert, round=2))
    with pytest.raises(SecAggError, match="not expected"):
        r.server.receive_advert(replace(advert, device="stranger"))
    r.server.receive_advert(advert)
    with pytest.raises(SecAggError, match="second key advert"):
        r.server.receive_advert(advert)
    with pytest.raises(SecAggError, match="out of order"):
        r.server.shares_for("dev-00")
    r.advertise([d for d in r.ids if d != "dev-00"])
    r.share()
    with pytest.raises(SecAggError, match="key advert out of order"):
        r.server.receive_advert(advert)
    with pytest.raises(SecAggError, match="second share batch"):
        r.server.receive_shares(r.batches["dev-00"])
    y = r.clients["dev-00"].masked_input(r.server.shares_for("dev-00"), r.vectors["dev-00"])
    with pytest.raises(SecAggError, match="has 3 values, not 16"):
        r.server.receive_masked(MaskedInput(1, "dev-00", y.vector[:3]))
    r.server.receive_masked(y)
    with pytest.raises(SecAggError, match="second masked input"):
        r.server.receive_masked(y)


def test_the_server_checks_who_a_batch_is_from_and_for(staged):
    r = staged(count=10, degree=4, threshold=3)
    r.advertise([d for d in r.ids if d != "dev-09"])
    me = "dev-00"
    batch = r.clients[me].share_keys(r.server.key_bundle(me))
    with pytest.raises(SecAggError, match="holds shares of another sender"):
        r.server.receive_shares(replace(batch, shares=(replace(batch.shares[0], sender="dev-01"),)
                                        + batch.shares[1:]))
    with pytest.raises(SecAggError, match="is addressed to"):
        r.server.receive_shares(replace(batch, shares=batch.shares[1:]))
    with pytest.raises(SecAggError, match="not expected"):
        r.server.receive_shares(replace(batch, device="dev-09"))  # it never advertised
    r.server.receive_shares(batch)


def test_too_few_senders_end_the_round_for_good(staged):
    r = staged(count=5)
    r.advertise()
    r.share(["dev-00", "dev-01"])
    with pytest.raises(SecAggAbandoned, match="2 devices sent shares, fewer than t=3"):
        r.server.shares_for("dev-00")
    with pytest.raises(SecAggAbandoned, match="fewer than t=3"):
        r.server.receive_masked(MaskedInput(1, "dev-00", r.vectors["dev-00"]))


def test_the_server_serves_only_the_devices_of_each_stage(staged):
    r = staged(count=8)  # t = 5
    r.advertise([d for d in r.ids if d != "dev-05"])
    with pytest.raises(SecAggError, match="dev-05 did not advertise keys"):
        r.server.key_bundle("dev-05")
    r.share([d for d in r.server.advertised if d != "dev-04"])
    with pytest.raises(SecAggError, match="dev-04 sent no shares"):
        r.server.shares_for("dev-04")
    with pytest.raises(SecAggError, match="not expected at this stage"):
        r.server.receive_masked(MaskedInput(1, "dev-04", r.vectors["dev-04"]))
    r.mask([d for d in r.server.shared if d != "dev-03"])
    with pytest.raises(SecAggError, match="dev-03 sent no masked input"):
        r.server.unmask_request("dev-03")
    assert r.server.dropped == {"dev-03"}


def test_unreadable_or_inconsistent_shares_are_refused_or_end_the_round(staged):
    r = run_to_unmask(staged, count=5)  # t = 3
    answers = {d: r.clients[d].unmask(r.server.unmask_request(d)) for d in sorted(r.server.survivors)}
    x, _ = decode_share(answers["dev-00"].b_shares[0][1])
    unreadable = x.to_bytes(2, "little") + b"\xff" * 66  # y >= p
    bad = replace(answers["dev-00"], b_shares=(("dev-00", unreadable),) + answers["dev-00"].b_shares[1:])
    with pytest.raises(SecAggError, match="dev-00's share of b_dev-00: share y must be below p"):
        r.server.receive_unmask(bad)
    y = decode_share(answers["dev-00"].b_shares[1][1])[1]
    shifted = (y - 2**256 * pow(lagrange_at_zero([1, 2, 3])[1], -1, PRIME)) % PRIME  # b_dev-01 + 2^256
    answers["dev-00"] = replace(answers["dev-00"], b_shares=(answers["dev-00"].b_shares[0],
                                                             ("dev-01", encode_share(1, shifted)),
                                                             *answers["dev-00"].b_shares[2:]))
    for answer in answers.values():
        r.server.receive_unmask(answer)
    total = r.server.result()  # the other shares of b_dev-01 rebuild the committed seed; dev-00's is skipped
    assert np.array_equal(total, np.sum(np.stack([r.vectors[d] for d in r.server.survivors]), axis=0, dtype=np.uint32))
    assert not r.server.faulty  # a false share of another's secret, or a false dealing to dev-00: not attributable
