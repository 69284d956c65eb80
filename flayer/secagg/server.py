"""The coordinator side of one secure-aggregation round: collect, route, and unmask only the sum.

Bonawitz et al. (CCS 2017), Fig. 4, server side, over the SecAgg+ graph (Bell et al., CCS 2020). The
device sets shrink stage by stage: U1 advertised keys, U2 sent shares (U2 within U1), U3 sent a masked
input (within U2); with the consistency round, the survivors are those of U3 that also consented
(:mod:`.server_consent`), and U2 minus the survivors dropped. Each stage closes when the wire layer first asks
for the next stage's output (``key_bundle``, ``shares_for``, ``consent_request``, ``unmask_request``, ``result``);
a set smaller than t ends the round with :class:`~flayer.secagg.errors.SecAggAbandoned`.

The server holds the running sum of the masked inputs, never one of them alone, and it reconstructs
b_u only for survivors and s_u^SK only for the dropped: ``_reconstruct`` refuses the second kind of
secret for any device (checked again on every share received), so no device's input is ever unmasked
on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Container, Mapping

import numpy as np

from . import keys, shamir
from .consistency import ServerConsistency
from .decoding import decoded, subsets
from .errors import SecAggAbandoned, SecAggError
from .graph import connected
from .messages import (
    Consent,
    ConsentRequest,
    KeyAdvert,
    KeyBundle,
    MaskedInput,
    ShareBatch,
    UnmaskRequest,
    UnmaskShares,
)
from .msg_setup import EncryptedShare
from .outlook import Outlook
from .params import SecAggParams
from .prg import expand
from .server_complaints import ComplaintStage
from .server_consent import ConsentBook, Recall
from .server_consistency import ConsistencyStage
from .signed_adverts import AdvertSignatureError, SignedAdvertStage
from .signed_shares import batch_problem

__all__ = ["SecAggServer"]

log = logging.getLogger(__name__)
_KINDS = ("b", "s")  # b: self-mask seed (survivors), s: mask private key (dropped)


class SecAggServer(ConsistencyStage, ComplaintStage, SignedAdvertStage):
    """The coordinator's state for one round; every input is checked against ``params`` and the stage."""

    def __init__(self, params: SecAggParams, consistency: ServerConsistency | None = None,
                 recall: Recall | None = None) -> None:
        self.params = params
        self.consistency = consistency  # the consistency round between masked inputs and unmasking (None: none)
        # the consent stage, with the consistency round (the same long-term keys); ``recall``: server_consent
        self.consent = ConsentBook(params, consistency.verify, recall) if consistency is not None else None
        self._signatures: dict[str, bytes] = {}
        self._signed_closed = False
        self._set_message: bytes | None = None
        self._stage = 1
        self._abandoned: str | None = None
        self._adverts: dict[str, KeyAdvert] = {}
        self._sent: dict[str, tuple[EncryptedShare, ...]] = {}
        self._inbox: dict[str, list[EncryptedShare]] = {}
        self._masked: set[str] = set()
        self._sum = np.zeros(params.length, dtype=np.uint32)
        self._requests: dict[str, UnmaskRequest] = {}
        self._responded: set[str] = set()
        self._shares: dict[str, dict[str, dict[int, int]]] = {"b": {}, "s": {}}
        self._seeds: dict[str, dict[str, bytes]] = {}  # dropped v -> {survivor u: the pair's mask seed s_uv}
        self._reconstructed: dict[str, set[str]] = {}
        self._result: np.ndarray | None = None
        self._complaints: set[tuple[str, str]] = set()  # (complainer, accused) pairs checked
        self.faulty: dict[str, str] = {}  # device -> what proves it faulty this round (named, left out later)
        self._outlook = Outlook(params)  # the shares each device could reveal (coordinator.secure_round)

    # -- the device sets ----------------------------------------------------------------------------
    @property
    def advertised(self) -> frozenset[str]:
        return frozenset(self._adverts)

    @property
    def shared(self) -> frozenset[str]:
        return frozenset(self._sent)

    @property
    def asked(self) -> frozenset[str]:  # the survivors sent an unmask request so far
        return frozenset(self._requests)

    @property
    def responded(self) -> frozenset[str]:  # the survivors whose unmask answer arrived
        return frozenset(self._responded)

    @property
    def survivors(self) -> frozenset[str]:  # U3 (masked inputs); once the consent stage closed, those that consented
        return frozenset(self._masked)

    @property
    def consented(self) -> frozenset[str]:  # the devices whose consent arrived (none without a consent stage)
        return self.consent.consented if self.consent is not None else frozenset()

    @property
    def dropped(self) -> frozenset[str]:
        """U2 minus the survivors, once stage 3 is closed (empty before: who will send a masked input is open)."""
        return frozenset(self._sent) - frozenset(self._masked) if self._stage >= 4 else frozenset()

    @property
    def reconstructed(self) -> Mapping[str, frozenset[str]]:
        """Device -> the kinds of secret rebuilt for it ("b" or "s", never both)."""
        return {d: frozenset(k) for d, k in self._reconstructed.items()}

    def shortfall(self, members: Collection[str], pending: Collection[str] = ()) -> str | None:
        """Why ``members`` could not unmask the sum, as far as this server knows (:class:`.outlook.Outlook`; ``pending``:
        those whose masked input may still come; with a consent stage, named devices' inputs are taken back out)."""
        return self._outlook.shortfall(members, self._sent, self._complaints, self.faulty, pending,
                                       named_out=self.consent is not None)

    # -- stage bookkeeping ---------------------------------------------------------------------------
    def _abandon(self, reason: str) -> SecAggAbandoned:
        self._abandoned = reason
        log.warning("secagg round %d abandoned: %s", self.params.round, reason)
        return SecAggAbandoned(reason)

    def _at(self, stages: tuple[int, ...], what: str) -> None:
        if self._abandoned is not None:
            raise SecAggAbandoned(self._abandoned)
        if self._stage not in stages:
            raise SecAggError(f"{what} out of order (the server is at stage {self._stage})")

    def _close(self, stage: int, members: frozenset[str], what: str) -> None:
        """Close ``stage`` (move to the next) unless fewer than t devices ``what``."""
        if self._stage == stage:
            if len(members) < self.params.threshold:
                raise self._abandon(f"{len(members)} devices {what}, fewer than t={self.params.threshold}")
            self._stage = stage + 1

    def _check(self, round_id: int, device: str, members: Container[str], what: str) -> None:
        if round_id != self.params.round:
            raise SecAggError(f"{what} from {device} is for round {round_id}, not {self.params.round}")
        if device not in members:
            raise SecAggError(f"{what} from {device}, which is not expected at this stage")

    # -- stage 1 -------------------------------------------------------------------------------------
    def receive_advert(self, advert: KeyAdvert) -> None:
        self._at((1,), "key advert")
        self._check(advert.round, advert.device, self.params.participants, "key advert")
        if advert.device in self._adverts:
            raise SecAggError(f"second key advert from {advert.device}")
        self._signature_problem(advert)  # first: a refused signature names nobody (the transport says who sent it)
        why = self._bad_keys(advert)
        if why is not None:
            self.faulty[advert.device] = why
            raise SecAggError(why)
        self._adverts[advert.device] = advert

    def key_bundle(self, device: str) -> KeyBundle:
        """The adverts of ``device``'s neighbours that advertised (closes stage 1 on the first call)."""
        self._at((1, 2), "key bundle")
        self._close(1, self.advertised, "advertised keys")
        if device not in self._adverts:
            raise SecAggError(f"{device} did not advertise keys")
        peers = sorted(self.params.neighbours(device) & self.advertised)  # each with its channel key toward device
        return KeyBundle(self.params.round, device, tuple(self._bundle_entry(v, device) for v in peers))

    # -- stage 2 -------------------------------------------------------------------------------------
    def receive_shares(self, batch: ShareBatch) -> None:
        self._at((2,), "share batch")
        sender = batch.device
        self._check(batch.round, sender, self._adverts, "share batch")
        if sender in self._sent:
            raise SecAggError(f"second share batch from {sender}")
        expected = self.params.neighbours(sender) & self.advertised
        if any(s.sender != sender for s in batch.shares):
            raise SecAggError(f"share batch from {sender} holds shares of another sender")
        receivers = [s.receiver for s in batch.shares]
        if set(receivers) != expected:
            raise SecAggError(f"share batch from {sender} is addressed to {sorted(receivers)}, not to its "
                              f"neighbours that advertised {sorted(expected)}")
        why = None if self.advert_verify is None else batch_problem(self.params, batch, self._pair_key,
                                                                    self.advert_verify)
        if why is not None:  # its sender's own batch (its envelope): the caller names it (coordinator.secure_round)
            raise AdvertSignatureError(why)
        self._sent[sender] = batch.shares
        for share in batch.shares:
            self._inbox.setdefault(share.receiver, []).append(share)

    def shares_for(self, device: str) -> ShareBatch:
        """The shares addressed to ``device`` (closes stage 2 on the first call)."""
        self._at((2, 3), "shares_for")
        self._close(2, self.shared, "sent shares")
        if device not in self._sent:
            raise SecAggError(f"{device} sent no shares")
        routed = [s for s in self._inbox.get(device, []) if s.sender in self._sent]
        return ShareBatch(self.params.round, device, tuple(sorted(routed, key=lambda s: s.sender)))

    # -- stage 3 -------------------------------------------------------------------------------------
    def receive_masked(self, masked: MaskedInput) -> None:
        self._at((3,), "masked input")
        self._check(masked.round, masked.device, self._sent, "masked input")
        if masked.device in self._masked:
            raise SecAggError(f"second masked input from {masked.device}")
        if masked.device in self.faulty:  # named by a complaint: counts as dropped (its masks removed)
            raise SecAggError(f"masked input from {masked.device}, named faulty: {self.faulty[masked.device]}")
        if masked.vector.shape != (self.params.length,):
            raise SecAggError(f"masked input from {masked.device} has {masked.vector.size} values, "
                              f"not {self.params.length}")
        if masked.bits != self.params.ring.bits:
            raise SecAggError(f"masked input from {masked.device} is in Z_2^{masked.bits}, not the round's "
                              f"Z_2^{self.params.ring.bits}")
        self._masked.add(masked.device)
        self._sum += masked.vector  # wraps mod 2^32; only the running sum is kept (and, without recall, the input
        if self.consent is not None:  # until its device consents: server_consent)
            self.consent.keep(masked.device, masked.vector)

    # -- the consent stage (with the consistency round) -----------------------------------------------
    def consent_request(self, device: str) -> ConsentRequest:
        """Ask ``device``, whose masked input arrived, for its consent (closes stage 3 on the first call)."""
        if self.consent is None:
            raise SecAggError("this round runs no consent stage")
        self._at((3, 4), "consent request")
        self._close(3, self.survivors, "sent a masked input")
        return self.consent.request(device, self.survivors)

    def receive_consent(self, msg: Consent) -> None:
        self._at((4,) if self.consent is not None else (), "consent")  # a round without one: out of order
        assert self.consent is not None
        self.consent.receive(msg, self.survivors, self.faulty)  # a named device's is refused: its input taken out

    def _close_masked(self) -> None:
        """Close stage 3 (and the consent stage): the survivors are fixed, at least t of them, connected."""
        if self.consent is None:
            if self._stage == 3:
                self._close(3, self.survivors, "sent a masked input")
                self._check_connected()
            return
        if self._stage == 3:
            raise SecAggError("the survivors asked for before the consent stage")
        if not self.consent.closed:
            try:
                self._masked = set(self.consent.close(frozenset(self._masked), self._sum))
            except SecAggError as exc:  # a masked input without a consent that cannot be read back
                raise self._abandon(str(exc)) from None
            if len(self._masked) < self.params.threshold:
                raise self._abandon(f"{len(self._masked)} devices sent a masked input and consented, fewer than "
                                    f"t={self.params.threshold}")
            self._check_connected()

    def unmask_request(self, device: str) -> UnmaskRequest:
        """Which of ``device``'s neighbours survived or dropped (closes stage 3 on the first call; with the consistency
        round, closes it on the first call and carries T of the survivors' signatures)."""
        self._at((3, 4), "unmask request")
        if self.consistency is not None and not self._signed_closed:
            if self._stage == 3:
                raise SecAggError("unmask request before the consistency round")
            need = self.signatures_needed
            if len(self._signatures) < need:
                raise self._abandon(f"{len(self._signatures)} survivors signed the survivor set, fewer than "
                                    f"T={need}")
            self._signed_closed = True
        self._close_masked()
        if device not in self._masked:
            raise SecAggError(f"{device} sent no masked input")
        if device not in self._requests:
            near = self.params.neighbours(device)
            sigs: tuple[tuple[str, bytes], ...] = ()
            certs: tuple[bytes, ...] = ()
            if self.consistency is not None:
                others = sorted(set(self._signatures) - {device})[:self.signatures_needed]  # the device counts itself
                sigs = tuple((s, self._signatures[s]) for s in others)
                certs = tuple(map(self.consistency.cert_of, others)) if self.consistency.cert_of else ()
            listed = tuple([device] + sorted(near & self.survivors))
            consents = self.consent.signatures(listed[1:]) if self.consent is not None else ()  # not its own
            self._requests[device] = UnmaskRequest(self.params.round, device, len(self._masked), listed,
                                                   tuple(sorted(near & self.dropped)), sigs, certs, consents)
        return self._requests[device]

    def _check_connected(self) -> None:
        """Abandon if the survivors' graph is split: each component's sum would be exposed."""
        if not connected(self.params.graph, self.survivors):
            raise self._abandon(f"the survivors' neighbour graph is split ({len(self.survivors)} survivors): "
                                "unmasking would expose partial sums")

    # -- stage 4 -------------------------------------------------------------------------------------
    def receive_unmask(self, msg: UnmaskShares) -> None:
        self._at((4,), "unmask shares")
        self._check(msg.round, msg.device, self._requests, "unmask shares")
        if msg.device in self._responded:
            raise SecAggError(f"second unmask answer from {msg.device}")
        request, x = self._requests[msg.device], self.params.x_of(msg.device)
        decoded: list[tuple[str, str, int]] = []
        for kind, entries, allowed in (("b", msg.b_shares, request.survivors), ("s", msg.s_shares, request.dropped)):
            for owner, raw in entries:  # survivors and dropped are disjoint: one kind per owner
                if owner not in allowed:
                    raise SecAggError(f"{msg.device} sent a share of {kind}_{owner}, which was not asked for")
                try:
                    share_x, y = shamir.decode_share(raw)
                except ValueError as exc:
                    raise SecAggError(f"{msg.device}'s share of {kind}_{owner}: {exc}") from None
                if share_x != x:
                    raise SecAggError(f"{msg.device} sent a share of {kind}_{owner} at x={share_x}, not {x}")
                decoded.append((kind, owner, y))
        for owner, _ in msg.pair_seeds:  # a dropped neighbour whose shares it does not hold: the pair's seed
            if owner not in request.dropped:
                raise SecAggError(f"{msg.device} sent its mask seed toward {owner}, which was not called dropped")
        self._responded.add(msg.device)
        for kind, owner, y in decoded:
            self._shares[kind].setdefault(owner, {})[x] = y
        for owner, seed in msg.pair_seeds:
            self._seeds.setdefault(owner, {})[msg.device] = seed

    def _reconstruct(self, owner: str, kind: str) -> bytes:
        """One secret of ``owner``, checked against what it advertised (the commitment to b_u, the key s_u^PK);
        every share beyond the t used is checked too. SecAggError if its other secret was rebuilt (the never-both
        rule); SecAggAbandoned if no t of the shares give the advertised secret.

        Who is named in :attr:`faulty`, only from what determines the dealer's polynomial (:func:`.decoding.decoded`,
        Reed-Solomon's unique decoding, ``2e <= m - t``): the owner, when its *own* share is off or when no t shares
        rebuild its advertised secret although m > t agree on one polynomial; never a holder for an off share of
        *another* device's secret (it may have lied, or the dealer sealed it that share): that share is skipped."""
        assert kind in _KINDS
        done = self._reconstructed.setdefault(owner, set())
        if done - {kind}:
            raise SecAggError(f"refusing to rebuild {kind}_{owner}: its other secret was rebuilt")
        done.add(kind)
        p, advert, shares = self.params, self._adverts[owner], self._shares[kind][owner]

        def genuine(secret: bytes) -> bool:
            if kind == "b":
                return keys.commit_seed(secret, p.session, p.round, owner) == advert.b_commit
            return keys.public_from_private(secret) == advert.s_pk

        fallback: bytes | None = None
        dealt_another = False  # the first t shares agree with the others on a secret that is not the advertised one
        for i, subset in enumerate(subsets(sorted(shares), p.threshold)):
            used = {x: shares[x] for x in subset}
            try:
                secret: bytes | None = shamir.combine(used, p.threshold)
            except ValueError:
                secret = None
            if secret is not None and genuine(secret):
                off = decoded(shares, used, p.threshold, kind == "b")
                if off is not None:
                    for x in off:
                        holder = p.participants[x - 1]
                        if holder == owner:
                            self.faulty[owner] = f"{owner} sent a false share of its own {kind}_{owner}"
                            log.warning("secagg round %d: %s", p.round, self.faulty[owner])
                        else:  # a lie or a false dealing: the coordinator cannot tell which
                            log.warning("secagg round %d: %s's share of %s_%s is off the polynomial: skipped",
                                        p.round, holder, kind, owner)
                    return secret
                fallback = fallback or secret  # genuine, but too many shares disagree to tell who lied
            elif i == 0 and len(shares) > p.threshold:
                dealt_another = decoded(shares, used, p.threshold, False) is not None
        if fallback is not None:
            return fallback  # unmasked with the genuine secret; nobody named
        if dealt_another:
            self.faulty[owner] = (f"{owner} dealt shares of {kind}_{owner} that agree on a secret other than "
                                  f"the {'seed it committed to' if kind == 'b' else 'key it advertised'}")
            log.warning("secagg round %d: %s", p.round, self.faulty[owner])
        raise self._abandon(f"no {p.threshold} of the {len(shares)} shares of {kind}_{owner} rebuild the "
                            f"{'seed it committed to' if kind == 'b' else 'key it advertised'}")

    def result(self) -> np.ndarray:
        """The ring sum (uint32, mod 2^bits) of the survivors' inputs; SecAggAbandoned if it cannot be had."""
        if self._result is not None:
            return self._result.copy()
        self._at((4,), "result")
        p = self.params
        by_seeds = {v for v in self.dropped  # every surviving neighbour sent its own pair's seed toward v
                    if p.neighbours(v) & self.survivors <= set(self._seeds.get(v, {}))}
        for kind, owners in (("b", sorted(self.survivors)), ("s", sorted(self.dropped))):
            for owner in owners:  # every count is checked before any secret is rebuilt
                have = len(self._shares[kind].get(owner, {}))
                if have < p.threshold and not (kind == "s" and owner in by_seeds):
                    raise self._abandon(f"{have} shares of {kind}_{owner} arrived, fewer than t={p.threshold}")
        self._stage = 5
        total = self._sum.copy()
        for u in sorted(self.survivors):
            total -= expand(self._reconstruct(u, "b"), p.length)
        for v in sorted(self.dropped):
            s_sk = self._reconstruct(v, "s") if len(self._shares["s"].get(v, {})) >= p.threshold else None
            for u in sorted(p.neighbours(v) & self.survivors):
                seed = self._seeds[v][u] if s_sk is None else \
                    keys.derive_mask_seed(keys.agree(s_sk, self._adverts[u].s_pk), p.session, p.round, u, v)
                if p.index(v) > p.index(u):  # y_u added PRG(s_uv) for v > u, subtracted it for v < u
                    total -= expand(seed, p.length)
                else:
                    total += expand(seed, p.length)
        self._shares, self._seeds = {"b": {}, "s": {}}, {}
        total &= np.uint32(p.ring.modulus - 1)  # the masks cancel mod 2^bits (2^bits divides 2^32)
        self._result = total
        return total.copy()

