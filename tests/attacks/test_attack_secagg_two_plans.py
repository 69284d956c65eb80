"""A coordinator that shows different devices different plans of one secure round (docs/explanation/
secure-aggregation.md, "What the coordinator can and cannot learn"; docs/explanation/design.md, "What a party signs
is what it relied on").

The adversary is the coordinator: it writes the plans (the plan is its own message), relays every advert, bundle,
sealed share, survivor set and unmask request, and in the second move holds one colluding device. Each device
runs the real :class:`edge_client.secure.SecureSession` on the plan it read (its own ``secure_from_plan``), signing
with its own Ed25519 key under the purposes of ``protocol.signing`` and checking the others against the
federation's registry. Same session, round and run seed in both plans; the cohorts differ, and with them the Shamir
x and the consistency round's majority.

* **Two plans, no colluder.** The victim W reads plan A; everyone else reads plan B, in which one device sorted
  first was added and one sorted last removed, and another added right after W and the one right before W removed:
  every one of W's 34 neighbours has moved its x by one, W has not, and the neighbour graph around W is the same.
  W seals each neighbour its shares at the x of plan A; each finds them at the wrong x and, on the code before,
  complained with its private channel key of the pair -- the key that opens both of W's shares sealed for it. 34 >=
  t = 18 shares of W's self-mask seed and of its mask key: W's input unmasked exactly.
* **Two plans and one colluder, against the consistency round.** The cohorts share W's neighbourhood (the same x
  and graph around W) and differ in 50 devices each. W and 16 of its neighbours (with 66 others) read plan A, in
  which W survived; 17 neighbours (with 50 others) read plan B, in which W dropped. Each plan's survivor set gets a
  majority of its own cohort's signatures (T = 51), so the one group reveals shares of W's seed, the other of its
  mask key, and the colluding neighbour both: t of each, W's input unmasked exactly.

Now every advert signature, survivor-set signature and sealed share's associated data covers the round's plan
digest (:attr:`flayer.secagg.SecAggParams.transcript`): a device reading plan B verifies nothing W signed under plan
A, and refuses the round before it seals anything or complains of anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from edge_client.secure import SecureSession
from flayer.engine.secure import graph_seed_of, plan_round, plan_secure, secure_from_plan
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import (
    ConsistencyRequest,
    DeviceConsistency,
    KeyBundle,
    SecAggError,
    ShareBatch,
    UnmaskRequest,
    decode_message,
    keys,
    shamir,
)
from flayer.secagg.client import SHARE_STAGE
from flayer.secagg.prg import expand
from flayer.update import TensorDelta, Update
from protocol import SignatureError
from protocol.signing import SigningKey, advert_signer, advert_verifier, survivor_signer, survivor_verifier

FED, ROUND, RUN_SEED = "fed", 1, 7
SESSION = f"{FED}.{ROUND}.ab"
LAYOUT = layout_of(Update({"w": TensorDelta((8,), np.zeros(3, np.float32), np.array([1, 4, 6]))}, 10))
SEED = graph_seed_of(RUN_SEED, ROUND)


def _hash_order(d: str) -> tuple[bytes, str]:  # the shuffled ring's order (flayer.secagg.graph), public
    return hashlib.sha256(b"flayer-secagg/v1/graph\x00" + SEED + d.encode()).digest(), d


class Registry:
    """The federation's key registry (``signing_keys.json``): every device's public key, never the coordinator's
    word."""

    def __init__(self, devices: list[str]) -> None:
        self.signers = {d: SigningKey.generate() for d in devices}

    def key_for(self, federation: str, device: str) -> Any:
        if federation != FED or device not in self.signers:
            raise SignatureError(f"no key for {device!r}")
        return self.signers[device].public


def _plan(cohort: list[str]) -> dict[str, Any]:
    """The plan's ``secure`` mapping as the coordinator's own code writes it for ``cohort``."""
    return plan_secure(plan_round(PrivacySettings(secure_aggregation=True), SESSION, ROUND, tuple(sorted(cohort)),
                                  LAYOUT, RUN_SEED, None, 1.0))


def _session(reg: Registry, d: str, cohort: list[str]) -> SecureSession:
    """Device ``d`` reads the plan it was shown, as a real edge client does (edge_client.secure)."""
    planned = secure_from_plan(_plan(cohort), ROUND, tuple(sorted(cohort)))
    assert planned is not None
    key = reg.signers[d]
    return SecureSession(planned, d, DeviceConsistency(
        survivor_signer(key, FED, ROUND, d), survivor_verifier(reg, FED, ROUND), 0.0,
        advert_signer(key, FED, ROUND, d), advert_verifier(reg, FED, ROUND)))


def _entry(sess: SecureSession, advert: Any, receiver: str) -> Any:
    """What the coordinator relays of ``advert`` to ``receiver``: the owner's key and signature toward it, in the
    order of the owner's own plan."""
    i = sorted(sess.planned.params.neighbours(advert.device)).index(receiver)
    key = advert.c_pk if i == 0 else advert.pair_pks[i - 1]
    return dataclasses.replace(advert, c_pk=key, pair_pks=(), signatures=(advert.signatures[i],))


def _run_keys_and_shares(sessions: dict[str, SecureSession], vectors: dict[str, np.ndarray]
                         ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, str]]:
    """Adverts, bundles (each device gets the neighbours whose plan makes it theirs too), sealed shares, masked
    inputs: (adverts, share batches sent, masked inputs, refusals)."""
    adverts = {d: decode_message(s.advert()) for d, s in sessions.items()}
    near = {d: s.planned.params.neighbours(d) for d, s in sessions.items()}
    batches, refused, masked = {}, {}, {}
    for d, s in sessions.items():
        linked = [o for o in sorted(near[d]) if o in sessions and d in near[o]]
        bundle = KeyBundle(ROUND, d, tuple(_entry(sessions[o], adverts[o], d) for o in linked))
        try:
            batches[d] = decode_message(s.on_message(bundle.to_bytes())[0])
        except SecAggError as exc:
            refused[d] = str(exc)
    for d in batches:
        incoming = tuple(sh for b in batches.values() for sh in b.shares if sh.receiver == d)
        sessions[d].on_message(ShareBatch(ROUND, d, incoming).to_bytes())
        try:
            masked[d] = sessions[d].client.masked_input(sessions[d].shares, vectors[d])
        except SecAggError as exc:
            refused[d] = str(exc)
    return adverts, batches, masked, refused


def _unmask_victim(w: SecureSession, masked: Any, adverts: dict[str, Any], b_shares: dict[int, int],
                   s_shares: dict[int, int]) -> np.ndarray | None:
    """W's input from t shares of each of its secrets and its masked input (None: too few shares)."""
    p = w.planned.params
    if masked is None or min(len(b_shares), len(s_shares)) < p.threshold:
        return None
    b_w, s_w = shamir.combine(b_shares, p.threshold), shamir.combine(s_shares, p.threshold)
    x = masked.vector.copy() - expand(b_w, p.length)
    for v in sorted(w.client.partners):
        seed = keys.derive_mask_seed(keys.agree(s_w, adverts[v].s_pk), p.session, p.round, w.device, v)
        x = x - expand(seed, p.length) if p.index(v) > p.index(w.device) else x + expand(seed, p.length)
    return x & np.uint32(p.ring.modulus - 1)


def _vectors(devices: list[str], modulus: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {d: rng.integers(0, modulus, LAYOUT.n, dtype=np.uint32) for d in devices}


def _moved_x_cohorts() -> tuple[list[str], list[str], str]:
    """(plan A's cohort, plan B's, W): in B every neighbour of W has another x, W the same, W's neighbours the same."""
    base = [f"dev-{i:03d}" for i in range(100)]
    order = sorted(base, key=_hash_order)
    for w in base[10:90]:
        i = order.index(w)
        arc = {order[(i + j) % 100] for j in range(-17, 18)}
        before, last = base[base.index(w) - 1], base[-1]
        if before in arc or last in arc:
            continue
        lo, hi = _hash_order(order[(i - 17) % 100]), _hash_order(order[(i + 17) % 100])
        outside = [c for n in range(400) for c in (f"aa-{n}", f"{w}-{n}")]
        pick = {}
        for c in outside:
            inside = lo <= _hash_order(c) <= hi if lo < hi else (_hash_order(c) >= lo or _hash_order(c) <= hi)
            if not inside:
                pick.setdefault(c.split("-")[0] == "aa", c)
        if len(pick) == 2:
            return base, [d for d in base if d not in (before, last)] + list(pick.values()), w
    raise AssertionError("no victim found")


def test_two_plans_with_no_colluder_recover_nothing() -> None:
    cohort_a, cohort_b, w = _moved_x_cohorts()
    reg = Registry(sorted(set(cohort_a) | set(cohort_b)))
    sessions = {w: _session(reg, w, cohort_a)} | {d: _session(reg, d, cohort_b) for d in cohort_b if d != w}
    pa, pb = sessions[w].planned.params, sessions[cohort_b[0]].planned.params
    near = pa.neighbours(w)
    assert near == pb.neighbours(w) and pa.threshold == 18 and len(near) == 34  # the same graph around W
    assert pa.x_of(w) == pb.x_of(w) and all(pa.x_of(v) != pb.x_of(v) for v in near)  # W's neighbours moved
    vectors = _vectors(list(sessions), pa.ring.modulus)
    adverts, batches, masked, refused = _run_keys_and_shares(sessions, vectors)
    # each complaint reveals the private channel key of the pair (v, W): the coordinator opens what W sealed for v
    b_shares: dict[int, int] = {}
    s_shares: dict[int, int] = {}
    leaked = {v: c.key for v in near if v in sessions for c in sessions[v].client.complaints() if c.accused == w}
    for v, key in leaked.items():
        sealed = next(sh for sh in batches[w].shares if sh.receiver == v)  # routed by the coordinator, kept
        channel = keys.derive_aead_key(keys.agree(key, _entry(sessions[w], adverts[w], v).c_pk), SESSION, ROUND, v, w)
        plain = keys.open_sealed(channel, sealed.ciphertext, keys.associated_data(
            SESSION, ROUND, w, v, SHARE_STAGE, pa.transcript), "W's share")
        x, y = shamir.decode_share(plain[:shamir.SHARE_LEN])
        b_shares[x], s_shares[x] = y, shamir.decode_share(plain[shamir.SHARE_LEN:])[1]
    got = _unmask_victim(sessions[w], masked.get(w), adverts, b_shares, s_shares)
    assert got is None or not np.array_equal(got, vectors[w]), "W's input unmasked from its neighbours' complaints"
    assert leaked == {}, f"{len(leaked)} neighbours of W handed over their channel keys toward W"
    assert w in refused and all(v in refused for v in near)  # each side verified nothing the other signed
    assert "is not signed by" in refused[w]


def _split_cohorts() -> tuple[list[str], list[str], list[str], str]:
    """(plan A's cohort, plan B's, the 69 shared devices in ring order, W): W's 34 neighbours and 17 more on either
    side shared by both plans, contiguous on the ring in both; 31 more in each plan, each in a gap of the shared
    devices' sorted order (the same gap in both plans: every shared device keeps its x) and outside the shared
    stretch of the ring (every shared device within it keeps its neighbours)."""
    core = [f"dev-{i:03d}" for i in range(69)]
    ring = sorted(core, key=_hash_order)
    lo, hi = _hash_order(ring[0]), _hash_order(ring[-1])
    extra: dict[str, list[str]] = {"a": [], "b": []}
    for tag, found in extra.items():
        for d in core[:31]:
            found.append(next(c for n in range(10_000) for c in [f"{d}-{tag}{n}"] if not lo <= _hash_order(c) <= hi))
    return core + extra["a"], core + extra["b"], ring, ring[34]


def test_two_plans_and_one_colluder_do_not_pass_the_consistency_round() -> None:
    cohort_a, cohort_b, ring, w = _split_cohorts()
    left, right = ring[17:34], ring[35:52]  # W's neighbours on either side of it on the ring
    colluder = left[-1]
    g_b = right  # 17 neighbours shown plan B, where W dropped: they reveal shares of W's mask key
    reg = Registry(sorted(set(cohort_a) | set(cohort_b)))
    readers_b = set(g_b) | set(ring[52:]) | (set(cohort_b) - set(cohort_a))
    sessions = {d: _session(reg, d, cohort_b if d in readers_b else cohort_a) for d in set(cohort_a) | readers_b}
    pa, pb = sessions[w].planned.params, sessions[g_b[0]].planned.params
    assert pa.neighbours(w) == pb.neighbours(w) == set(left) | set(right) and pa.threshold == 18
    assert all(pa.x_of(d) == pb.x_of(d) for d in ring)  # every holder of W at the same x in both plans
    vectors = _vectors(list(sessions), pa.ring.modulus)
    adverts, _, masked, refused = _run_keys_and_shares(sessions, vectors)
    held = sessions[colluder].client._held.get(w)  # the colluding neighbour hands over both of its shares of W
    # the consistency round: each plan's readers are shown their plan's survivor set, W in A's and not in B's; a
    # device shown the other plan is listed where every reader neighbouring it holds its shares
    shown: dict[str, frozenset[str]] = {}
    for name, params in (("A", pa), ("B", pb)):
        readers = {d for d in masked if sessions[d].planned.params.participants == params.participants}
        others = {d for d in masked if d not in readers and params.is_participant(d)
                  and all(d in sessions[g].client.partners for g in readers if d in params.neighbours(g))}
        s = frozenset(readers | others) - ({w} if name == "B" else set())
        for d in readers & s:
            shown[d] = s
    sigs: dict[frozenset[str], list[tuple[str, bytes]]] = {}
    for d, s in shown.items():
        try:
            sig = sessions[d].on_message(ConsistencyRequest(ROUND, d, tuple(sorted(s))).to_bytes())[0]
        except SecAggError as exc:
            refused[d] = str(exc)
            continue
        sigs.setdefault(s, []).append((d, decode_message(sig).signature))
    b_shares: dict[int, int] = {}
    s_shares: dict[int, int] = {}
    for d, s in shown.items():
        if d in refused:
            continue
        p = sessions[d].planned.params
        partners = sessions[d].client.partners
        ask = UnmaskRequest(ROUND, d, len(s), tuple(sorted((s & p.neighbours(d)) | {d})),
                            tuple(sorted(partners - s)), tuple(sigs.get(s, ())))
        try:
            got = decode_message(sessions[d].on_message(ask.to_bytes())[0])
        except SecAggError as exc:
            refused[d] = str(exc)
            continue
        for owner, share in got.b_shares:
            if owner == w:
                x, y = shamir.decode_share(share)
                b_shares[x] = y
        for owner, share in got.s_shares:
            if owner == w:
                x, y = shamir.decode_share(share)
                s_shares[x] = y
    if held is not None:
        for share, into in zip(held, (b_shares, s_shares), strict=True):
            x, y = shamir.decode_share(share)
            into[x] = y
    got_w = _unmask_victim(sessions[w], masked.get(w), adverts, b_shares, s_shares)
    assert got_w is None or not np.array_equal(got_w, vectors[w]), \
        f"W's input unmasked: {len(b_shares)} shares of its seed and {len(s_shares)} of its mask key"
    assert not s_shares or not b_shares, "W's holders revealed both kinds of W's shares"
    assert all(v in refused for v in g_b)  # the plan-B readers refused W's advert, signed under plan A
