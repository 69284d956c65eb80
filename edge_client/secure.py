"""This device's part of a secure round (docs/explanation/secure-aggregation.md).

The plan's ``secure`` mapping names the round's public parameters (:func:`flayer.engine.secure.secure_from_plan`).
A selected device:

1. sends its ``KeyAdvert`` on ``secagg/<id>`` as soon as it has the plan (beside its download and training), its
   keys toward each neighbour signed with its own key, its certificate from the federation's authority inside
   (:mod:`flayer.secagg.signed_adverts`);
2. checks every entry of the ``KeyBundle`` it reads on ``secreq/<id>``: the certificate it carries against the
   pinned authority key and the newest revocation list held, then the owner's signature under that certificate's key
   (:class:`protocol.certs.RoundCerts`; an entry that fails: the coordinator lied, and the device refuses the round)
   and answers
   with its ``ShareBatch`` (its self-mask seed and mask key, Shamir-shared and sealed for each neighbour);
3. once it has trained and holds the shares addressed to it, lays its upload out on the round's common
   positions, quantises it into the ring and masks it (:meth:`SecureSession.masked_blob`): that blob is its
   update of the round, sent, stored and re-sent like any update;
4. once its masked input has left, answers the ``ConsentRequest`` with its consent, signed with its own key: a
   private round is booked in its ledger, on disk, before the consent leaves (:mod:`edge_client.booking`);
5. signs the whole survivor set the coordinator shows it (``ConsistencyRequest``), once, with its own key -- also
   when the set leaves it out (a witness: its keys, shares or masked input came late), which then sends nothing more;
6. answers the ``UnmaskRequest`` with the shares it holds (one kind per neighbour: never both), and only when the
   request carries T valid signatures of other devices over the set it signed, each checked under the certificate
   the round's messages carried for its signer (or the federation's key registry on a device without a certificate:
   :mod:`edge_client.peer_keys`; :mod:`flayer.secagg.consistency`), and the consent of every survivor it lists,
   each checked under the key its neighbour's advert carried (no share of b_u for a u that did not consent).

Without a key registry (``signing_keys.json`` from its kit) a device can check none of the other devices' keys, so
it takes no part in secure rounds: it sends no advert (it would refuse every bundle, and before this every unmask
request). The keys and the shares live in this object only, never on disk: a restarted device cannot finish the round
and counts as dropped (its masked input, if it was sent, is unmasked with its neighbours' shares). What is on disk is
the round and session it advertised in, written before the advert leaves (``secure_advert`` in its state folder,
:mod:`edge_client.store`): after a restart it sits that session out instead of advertising other keys in it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from typing import Any

from flayer.engine.secure import PlannedSecure, secure_from_plan
from flayer.engine.secure_layout import layout_of
from flayer.secagg import (
    ConsentRequest,
    ConsistencyRequest,
    DeviceConsistency,
    KeyBundle,
    SecAggClient,
    SecAggError,
    ShareBatch,
    UnmaskRequest,
    decode_message,
)
from flayer.state import StateFileError
from flayer.update import Update
from protocol import (
    Envelope,
    Kind,
    Metrics,
    WireError,
    blob_digest,
    chunk_blob,
    decode_envelope,
    encode_message,
)
from protocol.plan_digest import plan_digest
from protocol.signing import advert_signer, advert_verifier, survivor_signer, survivor_verifier

from . import booking
from .certified_keys import round_keys
from .download import Pending
from .store import StoredState, UploadRecord
from .work import plan_terms

__all__ = ["SecureRounds", "SecureSession"]

log = logging.getLogger("edge_client.client")


class SecureSession:
    """One secure round's protocol state on this device (module docstring)."""

    def __init__(self, planned: PlannedSecure, device: str, consistency: DeviceConsistency | None) -> None:
        self.planned, self.device = planned, device
        self.client = SecAggClient(planned.params, device, os.urandom, consistency)
        self.shares: ShareBatch | None = None
        self.update: Update | None = None
        self.masked_sent = False
        self.privacy: dict[str, Any] = {}  # the plan's privacy parameters (a private round: counted when sent)
        self.terms = ""  # edge_client.work.plan_terms of the plan the session was opened under
        self.consenting = False  # the last message asked for its consent: booked before the answer leaves

    @property
    def round(self) -> int:
        return self.planned.params.round

    @property
    def session(self) -> str:
        return self.planned.params.session

    def advert(self) -> bytes:
        return self.client.advertise().to_bytes()

    def on_message(self, body: bytes) -> list[bytes]:
        """A message the coordinator addressed to this device; what to send back (SecAggError: refused)."""
        msg = decode_message(body)
        addressed = getattr(msg, "device", None)
        if addressed != self.device:  # the coordinator signed it for another device (the envelope names no
            # receiver): a copy moved to this device's topic is ignored, never refused, since a refusal would end
            # this device's part of the round for a message the coordinator never sent it
            raise SecAggError(f"a {type(msg).__name__} addressed to {addressed!r}, not to this device: ignored")
        if isinstance(msg, KeyBundle):
            return [self.client.share_keys(msg).to_bytes()]
        if isinstance(msg, ShareBatch):
            self.shares = msg
            return []
        if isinstance(msg, ConsentRequest):  # booked before the consent leaves (SecureRounds._on_secreq)
            out = [self.client.consent(msg).to_bytes()]
            self.consenting = True
            return out
        if isinstance(msg, ConsistencyRequest):
            return [self.client.sign_survivors(msg).to_bytes()]
        if isinstance(msg, UnmaskRequest):
            return [self.client.unmask(msg).to_bytes()]
        raise SecAggError(f"a {type(msg).__name__} is not a message for a device")

    def masked_blob(self) -> bytes | None:
        """The masked input once the update and the shares are both here (None: not yet); SecAggError when
        the update's layout is not the round's (it cannot join the sum)."""
        if self.client.left_out:  # it signed a survivor set without itself: its input would be in no sum
            self.masked_sent = True
        if self.masked_sent or self.update is None or self.shares is None:
            return None
        sent = self.planned.fitted(self.update)  # the round's kept share of the common positions (from the run seed)
        lay = layout_of(sent)
        if lay.digest != self.planned.layout:
            raise SecAggError("this device's upload positions, cut to the plan's keep fraction, are not the round's "
                              "layout (another strategy version or options, or a plan stating a subset other than "
                              "the run seed's): it cannot join the secure sum")
        vector = self.planned.vector(sent, lay)  # clipped to the round's bounds; rounding and noise: CSPRNG
        self.masked_sent = True
        return self.client.masked_input(self.shares, vector).to_bytes()

    def complaints(self) -> list[bytes]:
        """Complaints of shares that did not open (sent before the masked input; flayer.secagg.server_complaints)."""
        return [c.to_bytes() for c in self.client.complaints()]


class SecureRounds:
    """The edge client's secure rounds: a mixin of :class:`edge_client.client.EdgeClient` (module docstring)."""

    id: str
    settings: Any
    creds: Any
    signer: Any  # this device's SigningKey
    trust: Any  # the coordinator's key (protocol.PeerTrust): a secreq it did not sign is refused
    peers: Any  # the other devices' keys (edge_client.peer_keys.PeerKeys): the survivor signatures
    topics: Any
    link: Any
    store: Any
    stored: Any
    limits: Any
    clock: Any
    plan: Any
    rounds_trained: list[int]
    _secure: SecureSession | None
    _pending: Any
    _busy: bool
    _submit: Any  # edge_client.jobs (stubs here would shadow the mixins after this one)
    _publish: Any
    _update_items: Any
    _progress: Any
    _budget_refuses: Any  # edge_client.budget
    _record_contribution: Any
    _secure_sat_out = -1  # a round whose terms changed under its secure session, or advertised before a restart: sat out

    def _secure_plan(self, plan: Any) -> None:
        """A plan: open this device's session of a secure round it is selected for, and send its keys."""
        try:
            planned = secure_from_plan(plan.secure, plan.round, tuple(plan.selected),  # bound to the whole plan
                                       self.settings.secure_corrupt_fraction, plan.privacy, plan_digest(plan))
        except ValueError as exc:
            log.warning("%s: ignoring the plan's secure round: %s", self.id, exc)
            return
        cur = self._secure
        if planned is None or self.id not in plan.selected or plan.round <= self.stored.done_round \
                or self._budget_refuses(plan):  # past this device's own privacy budget (edge_client.budget)
            if cur is not None and (planned is None or cur.round != plan.round):
                self._secure = None  # that round is over
            return
        terms = plan_terms(plan)
        if plan.round == self._secure_sat_out:
            return  # this round's terms changed under its session, or it restarted after its advert: sat out
        if (cur is None or cur.session != planned.params.session) and self._advertised_before(plan.round,
                                                                                           planned.params.session):
            self._secure, self._secure_sat_out = None, plan.round
            return
        if cur is not None and cur.session == planned.params.session:
            if cur.terms != terms:  # the same session under other privacy or secure terms: neither is trusted
                log.warning("%s: secure round %d: the plan's privacy or secure terms changed under its session; this "
                            "device takes no part in the round (nothing of it is masked or counted)", self.id,
                            plan.round)
                self._secure, self._secure_sat_out = None, plan.round
            return  # the plan again (re-published, or the deadline extended)
        if not self.peers.available():  # edge_client.peer_keys logged where it looked
            log.warning("%s: secure round %d: no key registry to check the other devices' keys with: this device "
                        "takes no part (it would refuse the keys the coordinator relays)", self.id, plan.round)
            return
        fed = self.creds.federation
        gamma = max(planned.corrupt_fraction, self.settings.secure_corrupt_fraction)
        keys, own, admit = round_keys(self.peers)  # each certificate the round's messages carry (or the registry)
        consistency = DeviceConsistency(survivor_signer(self.signer, fed, plan.round, self.id),
                                        survivor_verifier(keys, fed, plan.round), gamma,
                                        advert_signer(self.signer, fed, plan.round, self.id),
                                        advert_verifier(keys, fed, plan.round), own, admit)
        session = SecureSession(planned, self.id, consistency)
        session.privacy, session.terms = dict(plan.privacy), terms
        advert = session.advert()
        try:  # on disk before the advert leaves: after a restart this device must not advertise other keys in it
            self.store.save_secure_advert(plan.round, session.session)
        except OSError as exc:
            log.error("%s: secure round %d: cannot record its advert in its state folder (%s): this device takes no "
                      "part in the round", self.id, plan.round, exc)
            return
        self._secure = session
        self._secure_publish([advert], plan.round)

    def _advertised_before(self, round_: int, session: str) -> bool:
        """Whether this device advertised keys in ``session`` of round ``round_`` and holds none of them now (it
        restarted since: its keys lived in memory). Such a device sits the round out, logged once: other keys in the
        same session would not match the advert the coordinator holds, which names the device faulty (equivocation)
        and leaves it out of every later round."""
        try:
            mark = self.store.secure_advert()
        except StateFileError as exc:  # it cannot tell which session it advertised in: it sits this one out, and
            log.error("%s: secure round %d: %s; this device sits the round out", self.id, round_, exc)
            try:  # records it as advertised (also after another restart), so the next round is taken part in
                self.store.save_secure_advert(round_, session)
            except OSError as err:
                log.error("%s: cannot replace %s: %s", self.id, self.store.advert_file, err)
            return True
        if mark != (round_, session):
            return False
        log.warning("%s: secure round %d: this device advertised its keys in the round's session before it restarted "
                    "and holds none of them now; it sits the round out (counted as dropped) and takes part in the "
                    "next", self.id, round_)
        return True

    def _secure_publish(self, bodies: list[bytes], round_: int) -> None:
        for body in bodies:
            env = Envelope(Kind.SECAGG, self.creds.federation, self.id, round_, 0, 1, len(body),
                           hashlib.sha256(body).hexdigest(), body)
            self.link.publish(self.topics.secagg(self.id), env.encode(self.signer))

    def _on_secreq(self, payload: bytes) -> None:
        """A message the coordinator addressed to this device (``secreq/<id>``: only the coordinator may write
        there, the broker's ACL)."""
        sec = self._secure
        env = decode_envelope(payload, self.limits, self.trust)  # only what the coordinator signed
        if env.kind != Kind.SECAGG:
            raise WireError(f"a {env.kind.name.lower()} envelope on this device's secure-round topic")
        if sec is None or env.round != sec.round:
            log.info("%s: a secure-round message of round %d, no such round here", self.id, env.round)
            return
        sec.consenting = False
        try:
            out = sec.on_message(env.body)
        except SecAggError as exc:
            log.warning("%s: secure round %d: refused a message: %s", self.id, sec.round, exc)
            return
        if sec.consenting and booking.book(self.stored.extra, self._record_contribution, sec.privacy, sec.round):
            self.store.save(self.stored)  # the round in the ledger on disk before the consent leaves
        self._secure_publish(out, sec.round)
        self._secure_send_masked()

    def _secure_trained(self, up: Any, round_: int) -> None:
        """The local round of a secure round is done: keep the state, mask the update once the shares are here."""
        self.stored = StoredState(up.state, round_, None, False, self.stored.extra)
        self.store.save(self.stored)
        self.rounds_trained.append(round_)
        sec = self._secure
        if sec is None or sec.round != round_:
            log.warning("%s: round %d trained, but it has no secure session (the plan moved on, or no key registry); "
                        "nothing sent",
                        self.id, round_)
            return
        if up.trained_under != sec.terms:  # trained, clipped and noised under another plan than the session's
            log.warning("%s: round %d was trained under other privacy or secure terms than its secure session; "
                        "nothing sent", self.id, round_)
            self._secure, self._secure_sat_out = None, round_
            return
        sec.update = up.update
        if not sec.privacy:  # a private round reports no evaluation: the counts and the loss are the device's data
            metrics = {k: float(v) for k, v in up.update.info.items() if k in ("test_correct", "test_total")}
            loss = (up.metrics or {}).get("train_loss")
            if isinstance(loss, float) and math.isfinite(loss):
                metrics["train_loss"] = loss
            self.link.publish(self.topics.metrics(self.id), encode_message(Metrics(round_, self.clock(), metrics),
                                                                           self.creds.federation, self.id,
                                                                           key=self.signer))
        self._progress("trained", round=round_, bytes=0, acc=up.eval.acc if up.eval else None, secure=True)
        self._secure_send_masked()

    def _secure_send_masked(self) -> None:
        sec = self._secure
        if sec is None or self._busy:
            return
        try:
            blob = sec.masked_blob()
        except SecAggError as exc:
            log.error("%s: secure round %d: %s", self.id, sec.round, exc)
            sec.masked_sent = True
            return
        if blob is None:
            return
        r = sec.round
        complaints = sec.complaints()
        if complaints:  # a neighbour's share did not open: the coordinator checks it, the round goes on
            log.warning("%s: secure round %d: complaining of %d neighbour share(s) that did not open", self.id, r,
                        len(complaints))
            self._secure_publish(complaints, r)
        digest = blob_digest(blob)
        payloads = tuple(chunk_blob(blob, Kind.UPDATE_CHUNK, self.creds.federation, self.id, r,
                                    self.creds.max_payload, key=self.signer))
        self.store.save_upload(blob)  # the masked input (nothing of the update readable), re-sent like an update
        self.stored = StoredState(self.stored.state, r, UploadRecord(r, digest, len(blob)), False, self.stored.extra,
                                  self.stored.on_disk)  # a released state stays the state file's
        self.store.save(self.stored)
        items = self._update_items(payloads, r)
        self._pending = Pending("update", r, digest, items)
        log.info("%s: round %d masked input sent (%d bytes)", self.id, r, len(blob))
        self._progress("sent", round=r, bytes=len(blob), secure=True)  # the bytes of the masked input
        self._submit("published", r, self._publish, items)
