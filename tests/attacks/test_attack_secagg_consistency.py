"""A coordinator that shows different devices different survivor sets, with one colluding device
(docs/explanation/secure-aggregation.md, "What the coordinator can and cannot learn").

The adversary is the coordinator: it routes every message of the round, chooses what each device reads, holds
the sum of the masked inputs and u's masked input y_u, and has one device C colluding with it (C's shares, C's
signing key). Its aim is u's input alone: t shares of u's self-mask seed b_u from holders told "u survived" and
t shares of u's mask key from holders told "u dropped" -- each honest holder reveals one kind, never both, so a
bare-majority t of u's k + 1 holders falls to one colluder in a sparse graph (2t - (k + 1) = 1).

Its moves: the key, share and masked-input stages run honestly; then it splits the honest survivors in two, shows
one group the whole survivor set S1 and the other S2 = S1 minus u, has C sign both, forwards to each device every
signature it holds over that device's set, and asks for the shares. It tries every split of the devices that
hold nothing of u. Each device checks T = floor((P + 1) / 2) + 1 signatures over the set it signed itself
(:mod:`flayer.secagg.consistency`); its only signatures are the devices' own (their keys come from the
federation's registry, never from the coordinator), so at most one of the two groups reaches T.
"""

from __future__ import annotations

import numpy as np
import pytest
from attacklib_secagg import honest_to_masked

from flayer.secagg import (
    ConsentRequest,
    ConsistencyRequest,
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    UnmaskRequest,
    consistency_threshold,
    expand,
    keys,
    shamir,
)
from flayer.secagg.consistency import survivor_set_message

IDS = tuple(f"dev-{i:02d}" for i in range(12))
K, T_SHARES, N = 4, 3, 64  # a sparse graph: t = 3 of the 5 holders, a bare majority


def _round(round_id: int, consistency: bool):
    params = SecAggParams("fed.1.ab", round_id, IDS, T_SHARES, K, bytes(32), N, RingSpec.for_summands(1.0, len(IDS)))
    ids = LocalIdentities(IDS, SeededEntropy(bytes([round_id]) * 32))
    clients = {d: SecAggClient(params, d, SeededEntropy(d.encode().ljust(32, b"\0")),
                               ids.for_device(d) if consistency else None) for d in IDS}
    rng = np.random.default_rng(round_id)
    inputs = {d: rng.integers(0, 2**32, N, dtype=np.uint32) for d in IDS}
    adverts, masked = honest_to_masked(SecAggServer(params), clients, inputs)
    consents = {d: clients[d].consent(ConsentRequest(params.round, d)).signature for d in IDS} if consistency else {}
    return params, ids, clients, inputs, adverts, masked, consents


def _attack(round_id: int, consistency: bool, to_b: int):
    """One round of the adversary's moves; u's input if it got both secrets, else None; and the devices' refusals."""
    params, ids, clients, inputs, adverts, masked, consents = _round(round_id, consistency)
    u = IDS[0]
    near = sorted(params.neighbours(u))
    colluder, told_survived, told_dropped = near[0], near[1:2], near[2:]
    others = [d for d in IDS if d != u and d not in near]
    group = {d: "S1" for d in [u, *told_survived, *others[:to_b]]}
    group.update({d: "S2" for d in [*told_dropped, *others[to_b:]]})
    sets = {"S1": frozenset(IDS), "S2": frozenset(IDS) - {u}}
    signatures: dict[str, dict[str, bytes]] = {"S1": {}, "S2": {}}
    refusals: dict[str, str] = {}
    for name, s in sets.items():  # the colluder signs both sets with its own key
        signatures[name][colluder] = ids.signer(colluder)(survivor_set_message(params.session, params.round, s,
                                                                                    params.transcript))
    if consistency:
        for d, name in group.items():
            try:
                sig = clients[d].sign_survivors(ConsistencyRequest(params.round, d, tuple(sorted(sets[name]))))
            except SecAggError as exc:
                refusals[d] = str(exc)
                continue
            signatures[name][d] = sig.signature
    b_shares: dict[int, int] = {}
    s_shares: dict[int, int] = {}
    held = clients[colluder]._held[u]  # the colluder's own memory: its shares of b_u and of s_u
    for raw, into in ((held[0], b_shares), (held[1], s_shares)):
        x, y = shamir.decode_share(raw)
        into[x] = y
    for d, name in group.items():
        if d in refusals:
            continue
        s = sets[name]
        mine = sorted((s & params.neighbours(d)) | {d})
        dropped = sorted(params.neighbours(d) - s)
        sigs = tuple(sorted((signer, sig) for signer, sig in signatures[name].items() if signer != d))
        listed = tuple([d] + [v for v in mine if v != d])  # with each listed survivor's consent (every device gave one)
        request = UnmaskRequest(params.round, d, len(s), listed, tuple(dropped), sigs,
                                consents=tuple((v, consents[v]) for v in listed if v in consents))
        try:
            answer = clients[d].unmask(request)
        except SecAggError as exc:
            refusals[d] = str(exc)
            continue
        for owner, raw in answer.b_shares:
            if owner == u:
                x, y = shamir.decode_share(raw)
                b_shares[x] = y
        for owner, raw in answer.s_shares:
            if owner == u:
                x, y = shamir.decode_share(raw)
                s_shares[x] = y
    if len(b_shares) < T_SHARES or len(s_shares) < T_SHARES:
        return None, inputs[u], refusals
    b_u = shamir.combine(b_shares, T_SHARES)
    s_u = shamir.combine(s_shares, T_SHARES)
    assert keys.public_from_private(s_u) == adverts[u].s_pk  # the genuine mask key
    x = masked[u] - expand(b_u, N)
    for v in near:
        seed = keys.derive_mask_seed(keys.agree(s_u, adverts[v].s_pk), params.session, params.round, u, v)
        if params.index(v) > params.index(u):
            x -= expand(seed, N)
        else:
            x += expand(seed, N)
    return x, inputs[u], refusals


def test_without_the_consistency_round_one_colluder_unmasks_one_device():
    """The attack as it stood before: devices that sign nothing hand over both secrets of u."""
    got, truth, refusals = _attack(1, consistency=False, to_b=4)
    assert not refusals
    assert got is not None and np.array_equal(got, truth)


@pytest.mark.parametrize("to_b", range(8))
def test_two_survivor_sets_and_one_colluder_unmask_no_device(to_b):
    got, truth, refusals = _attack(2 + to_b, consistency=True, to_b=to_b)
    assert got is None or not np.array_equal(got, truth), "the coordinator unmasked one device's input"
    assert any("fewer than T=" in why for why in refusals.values()), refusals
    assert consistency_threshold(len(IDS)) == 7


def test_a_device_signs_one_survivor_set_a_round():
    params, _ids, clients, *_ = _round(20, consistency=True)
    d = IDS[3]
    clients[d].sign_survivors(ConsistencyRequest(params.round, d, IDS))
    with pytest.raises(SecAggError, match="second survivor set"):
        clients[d].sign_survivors(ConsistencyRequest(params.round, d, IDS[1:]))


def test_a_forged_signature_is_not_counted():
    """Signatures the coordinator makes up (under names of survivors) do not verify under the devices' keys."""
    params, _ids, clients, *_ = _round(21, consistency=True)
    u = IDS[0]
    clients[u].sign_survivors(ConsistencyRequest(params.round, u, IDS))
    mine = sorted(params.neighbours(u) | {u})
    fake = tuple((d, bytes(64)) for d in IDS[1:])
    with pytest.raises(SecAggError, match="fewer than T=7"):
        clients[u].unmask(UnmaskRequest(params.round, u, len(IDS), tuple([u] + [v for v in mine if v != u]), (), fake))
