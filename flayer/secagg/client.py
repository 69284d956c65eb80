"""The device side of one secure-aggregation round: four stages of a pure state machine.

Bonawitz et al. (CCS 2017), Fig. 4, restricted to the device's neighbours N(u) (Bell et al., CCS 2020):

0. :meth:`SecAggClient.advertise`: fresh X25519 pairs (c_u for encryption, s_u for masks), the self-mask
   seed b_u drawn and committed to (its hash, bound to session, round and device, rides in the advert); with
   long-term keys (a :class:`~flayer.secagg.consistency.DeviceConsistency`) signed toward each neighbour.
1. :meth:`SecAggClient.share_keys`: with long-term keys, every bundle entry's signature checked against the registry
   first (:mod:`.signed_adverts`: one that does not verify refuses the round before anything is sealed); Shamir-split b_u and s_u^SK t-of-(k+1)
   at x = index + 1 of each neighbour that advertised and of u itself; seal each neighbour's pair
   of shares under c_uv (associated data bound to the plan's digest; with long-term keys signed,
   :mod:`.signed_shares`); keep u's own share of b_u.
2. :meth:`SecAggClient.masked_input`: open the shares received (their senders are the neighbours that
   completed stage 2) and send ``y_u = x_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)``
   (mod 2^bits, the round's ring width; v over those neighbours, ``>`` on the participant order).
3. :meth:`SecAggClient.consent` (with a :class:`~flayer.secagg.consistency.DeviceConsistency`): after its masked
   input, sign this device's consent to its input entering the round's revealed sum (:mod:`.msg_consent`; the
   caller books the round first). :meth:`SecAggClient.sign_survivors`: sign the whole survivor set the coordinator
   shows, once per round (the consistency round, :mod:`.consistency`).
4. :meth:`SecAggClient.unmask`: reveal the share of b_v for each surviving v and of s_v^SK for each
   dropped v -- never both for one v, and only once per round; with the consistency round only when this device is
   in the set it signed, the request matches that set, carries T valid signatures over it, and carries the consent
   of every survivor it lists, each verified here under that survivor's key.

Every stage checks what it can (round, addressee, sender in N(u), enough devices left: t) and
raises :class:`~flayer.secagg.errors.SecAggError` on anything else; after a refusal the client
answers nothing more this round. Randomness comes only from the ``entropy`` passed in.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from . import keys, shamir
from .consistency import DeviceConsistency, consistency_threshold, count_valid, survivor_set_message
from .errors import SecAggError
from .graph import connected
from .messages import (
    Consent,
    ConsentRequest,
    ConsistencyRequest,
    EncryptedShare,
    KeyAdvert,
    KeyBundle,
    MaskedInput,
    ShareBatch,
    ShareComplaint,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskShares,
)
from .msg_consent import consent_message
from .params import SecAggParams
from .prg import SEED_LEN, Entropy, expand, randbelow_from
from .signed_adverts import bundle_problem, device_signs, sign_advert
from .signed_shares import share_signed, sign_share

__all__ = ["SHARE_STAGE", "SecAggClient"]

log = logging.getLogger(__name__)
SHARE_STAGE = 2  # the stage byte bound into every sealed share's associated data
_FAILED = -1


class SecAggClient:
    """One device's state for one round (``params`` shared by all, ``device`` one of its participants)."""

    def __init__(self, params: SecAggParams, device: str, entropy: Entropy = os.urandom,
                 consistency: DeviceConsistency | None = None) -> None:
        if not params.is_participant(device):
            raise ValueError(f"device {device!r} is not a participant of round {params.round}")
        self.params = params
        self.device = device
        self._entropy = entropy
        self._stage = 0
        self._c: keys.KeyPair | None = None
        self._s: keys.KeyPair | None = None
        self._b: bytes | None = None
        self._own_b_share = b""
        self._peers: dict[str, KeyAdvert] = {}
        self._held: dict[str, tuple[bytes, bytes]] = {}  # neighbour -> (share of b_v, share of s_v)
        self._partners: frozenset[str] = frozenset()
        self._pairs: dict[str, keys.KeyPair] = {}  # neighbour -> this device's channel key pair toward it
        self._complaints: dict[str, bytes] = {}  # neighbour whose share did not open -> that pair's private key
        self._consistency = consistency  # None: no consistency round (a coordinator trusted to tell one story)
        self._signed: frozenset[str] | None = None  # the survivor set this device signed (once per round)
        self._consent: Consent | None = None  # this device's consent, once given (after its masked input)

    @property
    def partners(self) -> frozenset[str]:
        """The neighbours this device masked with (their shares reached it in stage 2)."""
        return self._partners

    def _enter(self, stage: int, what: str) -> None:
        if self._stage != stage:
            state = "refused an earlier message" if self._stage == _FAILED else f"is at stage {self._stage}"
            raise SecAggError(f"{self.device}: {what} out of order (the device {state})")

    def _refuse(self, reason: str) -> SecAggError:
        self._stage = _FAILED
        log.warning("secagg round %d, %s refuses: %s", self.params.round, self.device, reason)
        return SecAggError(f"{self.device} refuses: {reason}")

    def advertise(self) -> KeyAdvert:
        """Stage 1: this round's keys: a channel key pair per neighbour (so that a complaint reveals one pair's
        channel only), the mask key pair, and the commitment to b_u."""
        self._enter(0, "advertise")
        near = sorted(self.params.neighbours(self.device))
        self._pairs = {v: keys.generate_keypair(self._entropy) for v in near}
        self._c = self._pairs[near[0]]
        self._s = keys.generate_keypair(self._entropy)
        self._b = bytes(self._entropy(SEED_LEN))
        self._stage = 1
        p = self.params
        advert = KeyAdvert(p.round, self.device, self._c.public, self._s.public,
                           keys.commit_seed(self._b, p.session, p.round, self.device),
                           tuple(self._pairs[v].public for v in near[1:]),
                           cert=self._consistency.cert if self._consistency is not None else b"")
        signs = device_signs(self._consistency)
        return advert if signs is None else sign_advert(p, advert, signs[0])

    def complaints(self) -> tuple[ShareComplaint, ...]:
        """After stage 3: a complaint for each neighbour whose sealed share did not open (or held no share at this
        device's x), revealing this device's channel key of that pair only (:mod:`.server_complaints`)."""
        return tuple(ShareComplaint(self.params.round, self.device, v, key) for v, key in sorted(self._complaints.items()))

    def share_keys(self, bundle: KeyBundle) -> ShareBatch:
        """Stage 2: sealed shares of b_u and s_u^SK for each neighbour in ``bundle``."""
        self._enter(1, "share_keys")
        p, me = self.params, self.device
        assert self._c is not None and self._s is not None
        if bundle.round != p.round or bundle.device != me:
            raise self._refuse(f"key bundle is for {bundle.device} in round {bundle.round}")
        signs = device_signs(self._consistency)
        if signs is not None:  # keys their owner did not sign for this device: nothing is sealed under them
            admit = self._consistency.admit_cert if self._consistency is not None else None
            if (why := bundle_problem(p, me, bundle, signs[1], admit)) is not None:
                raise self._refuse(why)
        neighbours = p.neighbours(me)
        seen = {k.public for k in self._pairs.values()} | {self._s.public}
        for advert in bundle.adverts:
            if advert.device not in neighbours:
                raise self._refuse(f"key bundle holds {advert.device}, not a neighbour")
            if advert.c_pk in seen or advert.s_pk in seen or advert.c_pk == advert.s_pk:
                raise self._refuse(f"key bundle repeats a public key ({advert.device})")
            try:
                keys.check_public_key(advert.c_pk, f"{advert.device}'s c_pk")
                keys.check_public_key(advert.s_pk, f"{advert.device}'s s_pk")
            except SecAggError as exc:
                raise self._refuse(str(exc)) from None
            seen |= {advert.c_pk, advert.s_pk}
        if len(bundle.adverts) + 1 < p.threshold:
            raise self._refuse(f"{len(bundle.adverts)} neighbours advertised; t={p.threshold} needs "
                               f"{p.threshold - 1}")
        self._peers = {a.device: a for a in bundle.adverts}
        assert self._b is not None
        xs = [p.x_of(v) for v in sorted(self._peers)] + [p.x_of(me)]
        randbelow = randbelow_from(self._entropy)
        b_shares = shamir.split(self._b, p.threshold, xs, randbelow)
        s_shares = shamir.split(self._s.private, p.threshold, xs, randbelow)  # u's own s share is dropped
        self._own_b_share = shamir.encode_share(p.x_of(me), b_shares[p.x_of(me)])
        sealed = []
        for v in sorted(self._peers):
            x = p.x_of(v)
            key = keys.derive_aead_key(keys.agree(self._pairs[v].private, self._peers[v].c_pk), p.session, p.round, me, v)
            plain = shamir.encode_share(x, b_shares[x]) + shamir.encode_share(x, s_shares[x])
            ad = keys.associated_data(p.session, p.round, me, v, SHARE_STAGE, p.transcript)
            share = EncryptedShare(me, v, keys.seal(key, plain, ad, self._entropy))
            if signs is not None:  # signed: a share that does not authenticate is then provably its sender's
                share = sign_share(p, share, self._pairs[v].public, self._peers[v].c_pk, signs[0])
            sealed.append(share)
        self._stage = 2
        return ShareBatch(p.round, me, tuple(sealed))

    def masked_input(self, shares: ShareBatch, vector: np.ndarray) -> MaskedInput:
        """Stage 3: open the shares routed to this device and mask ``vector`` (uint32, ring-encoded)."""
        self._enter(2, "masked_input")
        p, me = self.params, self.device
        if self._signed is not None:  # it vouched for a survivor set without itself: its input joins no sum
            raise self._refuse("a masked input after this device signed a survivor set that leaves it out")
        assert self._c is not None and self._s is not None and self._b is not None
        if not (isinstance(vector, np.ndarray) and vector.dtype == np.uint32 and vector.shape == (p.length,)):
            raise ValueError(f"vector must be a uint32 array of shape ({p.length},), got "
                             f"{getattr(vector, 'dtype', type(vector).__name__)} {getattr(vector, 'shape', '')}")
        if p.ring.bits < 32 and int(vector.max()) >= p.ring.modulus:
            raise ValueError(f"vector holds values outside Z_2^{p.ring.bits}")
        if shares.round != p.round or shares.device != me:
            raise self._refuse(f"share batch is for {shares.device} in round {shares.round}")
        held: dict[str, tuple[bytes, bytes]] = {}
        unopened: set[str] = set()
        signs = device_signs(self._consistency)
        for share in shares.shares:
            if share.receiver != me:
                raise self._refuse(f"share from {share.sender} is addressed to {share.receiver}")
            if share.sender not in self._peers:
                raise self._refuse(f"share from {share.sender}, whose keys this device never received")
            signed = signs is not None and share_signed(p, share, self._peers[share.sender].c_pk,
                                                        self._pairs[share.sender].public, signs[1])
            if signs is not None and not signed:  # altered or replayed by whoever routed it: proves nothing
                log.warning("secagg round %d, %s: the share from %s is not signed by %s; holding nothing of it (no "
                            "complaint)", p.round, me, share.sender, share.sender)
                unopened.add(share.sender)
                continue
            plain = self._unseal(share.sender, share.ciphertext)
            got = None if plain is None else self._shares_in(share.sender, plain)
            if plain is None and signed:  # the sender signed a share that does not authenticate: its own fault
                self._complaints[share.sender] = self._pairs[share.sender].private
            elif plain is None:  # unsigned and routed: could have been altered, proves nothing, and the pair's key
                unopened.add(share.sender)  # would open what the sender really sealed here (both secrets' shares)
            elif got is None:  # opened under the pair's key (only the sender and this device hold it): the
                self._complaints[share.sender] = self._pairs[share.sender].private  # sender's fault, or a lie
            else:
                held[share.sender] = got
        partners = frozenset(held) | frozenset(self._complaints) | frozenset(unopened)  # every neighbour that sent
        if len(held) + 1 < p.threshold:
            raise self._refuse(f"{len(held)} neighbours' shares opened; t={p.threshold} needs {p.threshold - 1}")
        self._held, self._partners = held, partners
        y = vector.copy()
        y += expand(self._b, p.length)
        mine = p.index(me)
        for v in sorted(partners):
            seed = keys.derive_mask_seed(keys.agree(self._s.private, self._peers[v].s_pk),
                                         p.session, p.round, me, v)
            if p.index(v) > mine:
                y += expand(seed, p.length)
            else:
                y -= expand(seed, p.length)
        if p.ring.bits < 32:  # masks and input live in Z_{2^bits}: the ring's width is all that travels
            y &= np.uint32(p.ring.modulus - 1)
        self._stage = 3
        return MaskedInput(p.round, me, y, p.ring.bits)

    def _unseal(self, sender: str, ciphertext: bytes) -> bytes | None:
        """The plaintext ``sender`` sealed for this device, or None when it does not authenticate. Complained of only when
        the sender signed the share (:mod:`.signed_shares`): the coordinator routes every sealed share and can alter an
        unsigned one, and the key a complaint reveals would open the ciphertext the sender really sealed -- the
        coordinator making t neighbours of one device complain would hold t shares of both its secrets."""
        p, me = self.params, self.device
        key = keys.derive_aead_key(keys.agree(self._pairs[sender].private, self._peers[sender].c_pk),
                                   p.session, p.round, me, sender)
        ad = keys.associated_data(p.session, p.round, sender, me, SHARE_STAGE, p.transcript)
        try:
            return keys.open_sealed(key, ciphertext, ad, f"share from {sender}")
        except SecAggError as exc:
            log.warning("secagg round %d, %s: %s; holding nothing of %s", p.round, me, exc, sender)
            return None

    def _shares_in(self, sender: str, plain: bytes) -> tuple[bytes, bytes] | None:
        """The (b, s) shares in what ``sender`` sealed, or None when they are not shares at this device's x (a
        complaint: the plaintext authenticated under the pair's key, which only the sender and this device hold)."""
        p, me = self.params, self.device
        b_share, s_share = plain[:shamir.SHARE_LEN], plain[shamir.SHARE_LEN:]
        try:
            xs = {shamir.decode_share(b_share)[0], shamir.decode_share(s_share)[0]}
        except ValueError:
            xs = set()
        if xs != {p.x_of(me)}:
            log.warning("secagg round %d, %s: the share from %s is no share at this device's x; complaining",
                        p.round, me, sender)
            return None
        return b_share, s_share

    def consent(self, request: ConsentRequest) -> Consent:
        """The consent stage: this device's signature consenting to its masked input entering the round's revealed sum
        (the same one when asked again). Refused before its masked input was made: nothing of it can be summed."""
        p, me, cons = self.params, self.device, self._consistency
        if self._consent is not None and (request.round, request.device) == (p.round, me):
            return self._consent
        self._enter(3, "consent")  # its masked input made: stage 3
        if cons is None:
            raise self._refuse("asked to consent, but this device runs no consistency round (no long-term key)")
        if request.round != p.round or request.device != me:
            raise self._refuse(f"consent request is for {request.device} in round {request.round}")
        if self._signed is not None:
            raise self._refuse("asked to consent after this device signed a survivor set")
        self._consent = Consent(p.round, me, cons.sign(consent_message(p.session, p.round, me, p.transcript)))
        return self._consent

    def sign_survivors(self, request: ConsistencyRequest) -> SurvivorSignature:
        """The consistency round: sign the whole survivor set shown, once (a second set is refused). A participant
        left out of the set -- its keys, shares or masked input came late, or never -- signs it too, as a witness
        (any participant's one signature binds as much: T counts the cohort, :mod:`.consistency`); it then sends
        no masked input this round."""
        p, me, cons = self.params, self.device, self._consistency
        witness = me not in frozenset(request.survivors) and self._stage != _FAILED and self._signed is None
        if not witness or self._stage > 3:  # a witness that answered an unmasking already: refused as before
            self._enter(3, "sign_survivors")
        if cons is None:
            raise self._refuse("asked to sign a survivor set, but this device runs no consistency round")
        if request.round != p.round or request.device != me:
            raise self._refuse(f"consistency request is for {request.device} in round {request.round}")
        if self._signed is not None:
            raise self._refuse("asked to sign a second survivor set this round")
        survivors = frozenset(request.survivors)
        if strangers := sorted(d for d in survivors if not p.is_participant(d)):
            raise self._refuse(f"the survivor set names {strangers[:5]}, not participants of the round")
        need = consistency_threshold(len(p.participants), cons.corrupt_fraction)
        if len(survivors) < max(need, p.threshold):
            raise self._refuse(f"{len(survivors)} survivors listed, fewer than the {max(need, p.threshold)} "
                               "the unmasking needs")
        if not connected(p.graph, survivors):  # each part's masks would cancel alone: its sum exposed
            raise self._refuse("the survivor set's neighbour graph is split: each part's sum could be unmasked "
                               "on its own")
        if not witness and self._consent is None:
            raise self._refuse("the survivor set holds this device, which never consented to its input being summed")
        if unknown := (sorted((survivors & p.neighbours(me)) - self._partners) if not witness else []):
            raise self._refuse(f"the survivor set holds neighbours {unknown}, whose shares never reached this device")
        self._signed = survivors
        message = survivor_set_message(p.session, p.round, survivors, p.transcript)
        return SurvivorSignature(p.round, me, cons.sign(message))

    @property
    def left_out(self) -> bool:
        """This device signed a survivor set without itself: it sends no masked input (nor consent) after this."""
        return self._signed is not None and self.device not in self._signed

    def _check_consistent(self, request: UnmaskRequest) -> None:
        """With the consistency round: this device is in the set it signed, the request is its view of that set (the
        survivor count its size), T devices of that set signed it (:mod:`.consistency`). A witness (it signed a set
        without itself) answers nothing: it dropped in every device's view, its s_u is revealed by its neighbours, and
        its own share of b_u would be the t-th for t-1 colluders (its input alone); only survivors are asked."""
        p, me, cons, signed = self.params, self.device, self._consistency, self._signed
        assert cons is not None
        if signed is None:
            raise self._refuse("an unmask request before this device signed a survivor set")
        if me not in signed:
            raise self._refuse("an unmask request after this device signed a survivor set without itself: it dropped "
                               f"in every device's view, and its own share of b_{me} never leaves it")
        mine, dropped = signed & (p.neighbours(me) | {me}), self._partners - signed
        if set(request.survivors) != mine or set(request.dropped) != dropped:
            raise self._refuse("the unmask request does not match the survivor set this device signed")
        if request.survivor_count != len(signed):
            raise self._refuse(f"a survivor count {request.survivor_count}, not the {len(signed)} of the set signed")
        if cons.admit_cert is not None:  # the signers' certificates, checked against the authority here
            for (signer, _), cert in zip(request.signatures, request.certs, strict=False):
                cons.admit_cert(signer, cert)  # a refused one leaves its signature uncounted
        message = survivor_set_message(p.session, p.round, signed, p.transcript)
        good = count_valid(message, frozenset(p.participants), request.signatures, cons.verify)  # witnesses count
        good.add(me)
        need = consistency_threshold(len(p.participants), cons.corrupt_fraction)
        if len(good) < need:
            raise self._refuse(f"{len(good)} devices signed the survivor set this device signed, fewer than "
                               f"T={need}: the coordinator may have shown others another set")
        self._check_consents(request)

    def _check_consents(self, request: UnmaskRequest) -> None:
        """Every survivor the request lists consented (its signature over :func:`consent_message`, verified here under
        its own key): a share of b_u leaves only for a u that booked the round before consenting."""
        p, me, cons = self.params, self.device, self._consistency
        assert cons is not None
        if self._consent is None:
            raise self._refuse("an unmask request, but this device never consented to its input being summed")
        given = dict(request.consents)  # one per device (UnmaskRequest checks it)
        for u in sorted(set(request.survivors) - {me}):
            sig = given.get(u)
            if sig is None:
                raise self._refuse(f"the unmask request lists {u} as a survivor without its consent: no share of b_{u} "
                                   "is revealed for a device that has not consented")
            if not cons.verify(u, consent_message(p.session, p.round, u, p.transcript), sig):
                raise self._refuse(f"the consent the unmask request carries for {u} does not verify under {u}'s key "
                                   f"(another round, plan or device, or forged): no share of b_{u} is revealed")

    def unmask(self, request: UnmaskRequest) -> UnmaskShares:
        """Stage 4: shares of b_v for the surviving, of s_v^SK for the dropped neighbours (once)."""
        self._enter(3, "unmask")
        p, me = self.params, self.device
        if request.round != p.round or request.device != me:
            raise self._refuse(f"unmask request is for {request.device} in round {request.round}")
        if self._consistency is not None:
            self._check_consistent(request)
        both = set(request.survivors) & set(request.dropped)
        if both:
            raise self._refuse(f"asked for both shares of {sorted(both)}")
        if me not in request.survivors:
            raise self._refuse("the request does not list this device among the survivors")
        if len(request.survivors) < p.threshold:  # the list, never a count the coordinator states
            raise self._refuse(f"{len(request.survivors)} survivors listed (this device and its surviving "
                               f"neighbours), fewer than t={p.threshold}: b_{me} could not be rebuilt, and the "
                               "shares of the neighbours called dropped would unmask them")
        if request.survivor_count < len(request.survivors):
            raise self._refuse(f"a survivor count {request.survivor_count} below the {len(request.survivors)} listed")
        listed = (set(request.survivors) | set(request.dropped)) - {me}
        if listed - self._partners:
            raise self._refuse(f"the request lists {sorted(listed - self._partners)}, whose shares "
                               "never reached this device")
        if self._partners - listed:
            raise self._refuse(f"the request leaves out {sorted(self._partners - listed)}, "
                               "which completed stage 2")
        held = self._held  # a neighbour complained of is listed, but this device holds nothing of it
        b_out = [(me, self._own_b_share)] + [(v, held[v][0]) for v in sorted(request.survivors) if v in held]
        s_out = [(v, held[v][1]) for v in sorted(request.dropped) if v in held]
        assert self._s is not None  # a dropped neighbour whose shares did not open: the pair's own mask seed
        seeds = [(v, keys.derive_mask_seed(keys.agree(self._s.private, self._peers[v].s_pk), p.session, p.round, me, v))
                 for v in sorted(request.dropped) if v not in held]
        self._stage = 4
        self._b, self._s, self._c, self._held, self._pairs = None, None, None, {}, {}  # nothing is needed again
        return UnmaskShares(p.round, me, tuple(b_out), tuple(s_out), tuple(seeds))
