"""A secure round at the coordinator: the four SecAgg+ stages over MQTT (docs/explanation/secure-aggregation.md).

Driven by the coordinator's worker thread (its messages and ticks), over :class:`flayer.secagg.SecAggServer`:

1. **Keys.** The plan carries the round's public parameters (:func:`flayer.engine.secure.plan_secure`); each
   selected device sends its ``KeyAdvert`` on ``secagg/<client>``, its keys toward each neighbour signed with its
   own key; the signatures are checked against the federation's registry (a bad one refuses the advert, and since
   the envelope proved who sent it, names the device faulty: :mod:`flayer.secagg.signed_adverts`). When every
   selected device has advertised, or ``secure_stage_s`` has passed, each advertiser gets its neighbours' keys with
   their owners' signatures (``KeyBundle`` on ``secreq/<client>``, which only that device may read).
2. **Shares.** Each advertiser sends its ``ShareBatch`` (sealed for each neighbour: the coordinator relays
   what it cannot read); when all have, or the stage's time is up, each gets the shares addressed to it. A device
   that cannot open one sends a ``ShareComplaint`` before its masked input (:mod:`flayer.secagg.server_complaints`):
   the sender, or a false complainer, is named faulty and the round goes on.
3. **Masked inputs** arrive as the round's update blobs -- the update path's chunks, memory budget, journal
   and ack (:meth:`SecureRound.masked`) -- and the round's timer ends the stage as it ends a plain round
   (quorum and grace, or the deadline), with two exceptions from the shares each device could reveal
   (:mod:`flayer.secagg.outlook`): quorum and grace do not end it while the masked inputs in could not be unmasked
   and a device that shared could still complete them (:meth:`SecureRound.held`: until then, or the deadline), and
   a round that no set of devices still able to send could unmask ends at once, before any consent is asked (a
   complaint can leave too few holders of a device's shares).
4. **Consent.** Each device whose masked input arrived is asked for its consent (``ConsentRequest``); it books the
   round in its own privacy ledger, then signs its consent with its own key (``Consent``, checked against the
   federation's registry or the certificate its advert carried); when all have, or the stage's time is up, the
   survivors are the devices whose masked input and consent arrived: a masked input without a consent is read back
   from the round's journal and taken out of the sum, its device counted as dropped (:mod:`flayer.secagg.server_consent`).
5. **Consistency.** Each participant gets the whole survivor set (``ConsistencyRequest``) and signs it with its own
   key (``SurvivorSignature``, checked against the federation's registry); when all have, or the stage's time is up,
   the signatures travel on in the unmask requests (fewer than T abandon the round: :mod:`flayer.secagg.consistency`).
6. **Unmasking.** Each survivor gets its ``UnmaskRequest``, with the consent of each survivor it lists (a neighbour
   reveals its share of b_u only for a u whose consent it verifies); when all answered, or the stage's time is up, the
   sum is rebuilt (:meth:`SecureRound.finish`): decoded, checked against what ``count`` clipped uploads can
   reach, and folded. Too few survivors or shares abandon the round with the reason; the model stays.

A refused protocol message (out of stage, from a device not selected, forged, a second answer) changes
nothing and is counted. A restarted coordinator never resumes a secure round: the devices' keys and shares
lived in memory only, so a journaled secure round is abandoned and the next one starts with new keys
(:meth:`coordinator.cycle.RoundCycle.restore`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from flayer.engine.secure import PlannedSecure, SecureSum, sum_update
from flayer.engine.secure_layout import Layout
from flayer.secagg import (
    Consent,
    KeyAdvert,
    MaskedInput,
    SecAggAbandoned,
    SecAggError,
    SecAggServer,
    ServerConsistency,
    ShareBatch,
    ShareComplaint,
    SurvivorSignature,
    UnmaskShares,
    decode_message,
)
from flayer.secagg.server_consent import Recall
from flayer.secagg.signed_adverts import AdvertSignatureError
from protocol.certs import RoundCerts

from .secure_timing import StageTiming

__all__ = ["SecureRound"]

log = logging.getLogger(__name__)

_STAGE_MESSAGE = {1: KeyAdvert, 2: ShareBatch, 3: ShareComplaint, 4: Consent, 5: SurvivorSignature, 6: UnmaskShares}
_MESSAGE_STAGE = {KeyAdvert: 1, ShareBatch: 2, Consent: 4, SurvivorSignature: 5, UnmaskShares: 6}


@dataclass
class SecureRound:
    """One round's protocol state at the coordinator (module docstring)."""

    planned: PlannedSecure
    layout: Layout
    stage_end: float
    stage: int = 1
    server: SecAggServer = field(init=False)
    sent_bytes: int = 0  # protocol messages sent to devices (the update path counts the masked inputs)
    verify: Callable[[str, bytes, bytes], bool] | None = None  # the devices' keys (the survivor signatures)
    verify_advert: Callable[[str, bytes, bytes], bool] | None = None  # the same keys for the adverts (None: verify)
    timing: StageTiming | None = None  # each stage's limit from the fleet's measured latencies (None: stage_s)
    gone: Callable[[str], bool] = lambda device: False  # a device known to be offline (it cannot answer now)
    opened: float = 0.0  # when the current stage opened (latencies are measured from it)
    asked: set[str] = field(default_factory=set)  # the devices sent the survivor set to sign
    stage_opened: dict[int, float] = field(default_factory=dict)  # stage -> when it opened
    refused: str | None = None  # why the round must not run (flayer.engine.secure_plan.failure_problem): ended at once
    certs: RoundCerts | None = None  # the adverts' certificates, checked on arrival (None: the key registry)
    recall: Recall | None = None  # a masked input read back (the round's journal) when its device gave no consent
    held_until: float | None = None  # the masked inputs' stage held open past quorum and grace, until then (held)

    def __post_init__(self) -> None:
        self.server = self._new_server()
        self.opened = self.stage_end - self._limit(1)
        self.stage_opened[1] = self.opened

    def bind(self, plan: bytes) -> bool:
        """Bind the round's transcript to ``plan``, the digest of the plan the devices read
        (:func:`protocol.plan_digest.plan_digest`), once, before the plan goes out; False when it is bound to another
        (a bound field changed on a re-publication: the devices that read each verify nothing of the others)."""
        if self.planned.plan:
            return self.planned.plan == plan
        self.planned = self.planned.bind(plan)
        self.server = self._new_server()
        return True

    def _new_server(self) -> SecAggServer:
        c = self.certs
        return SecAggServer(self.planned.params, ServerConsistency(
            self.verify, self.planned.corrupt_fraction, self.verify_advert, c.admit if c is not None else None,
            c.cert_of if c is not None else None), self.recall)

    def _limit(self, stage: int) -> float:
        return self.timing.limit(stage) if self.timing is not None else self.planned.stage_s

    @property
    def needed(self) -> int:
        """The fewest survivors (and signers) the unmasking needs: max(t, T) (devices refuse a smaller set)."""
        return self.server.signatures_needed

    def observe(self, msg: object, now: float) -> None:
        """Note how long a stage's message took (late ones too: what the fleet takes, :mod:`.secure_timing`)."""
        stage = _MESSAGE_STAGE.get(type(msg))
        if self.timing is not None and stage is not None:
            start = self.stage_opened.get(stage)
            if start is not None:
                self.timing.observe(stage, now - start)

    def _open_stage(self, stage: int, now: float) -> None:
        self.stage, self.opened, self.stage_end = stage, now, now + self._limit(stage)
        self.stage_opened[stage] = now

    @property
    def participants(self) -> tuple[str, ...]:
        return self.planned.params.participants

    def receive(self, client: str, body: bytes, now: float | None = None) -> str | None:
        """A device's protocol message (keys, shares, unmasking shares); the reason it is refused, or None."""
        try:
            msg = decode_message(body)
        except SecAggError as exc:
            return f"malformed secure-round message: {exc}"
        if now is not None and getattr(msg, "device", None) == client:
            self.observe(msg, now)
        want = _STAGE_MESSAGE.get(self.stage)
        if want is None or not isinstance(msg, want):
            return f"{type(msg).__name__} in stage {self.stage} of the secure round"
        if msg.device != client:
            return f"a {type(msg).__name__} naming {msg.device!r}, sent by {client!r}"
        try:
            if isinstance(msg, KeyAdvert):
                try:
                    self.server.receive_advert(msg)
                except AdvertSignatureError as exc:  # its envelope verified under client's own key: its own word
                    self.server.name_faulty(client, f"{client}'s key advert is refused: {exc}")
                    raise
            elif isinstance(msg, ShareBatch):
                try:
                    self.server.receive_shares(msg)
                except AdvertSignatureError as exc:  # a share its sender did not sign, in the sender's envelope
                    self.server.name_faulty(client, f"{client} signed its sealed shares falsely: {exc}")
                    raise
            elif isinstance(msg, Consent):
                self.server.receive_consent(msg)
            elif isinstance(msg, SurvivorSignature):
                self.server.receive_signature(msg)
            elif isinstance(msg, ShareComplaint):  # checked at once: the accused, or a false complainer, is named
                named = self.server.receive_complaint(msg)
                log.warning("round %d: %s complained of %s's share; %s named faulty", self.planned.params.round,
                            client, msg.accused, named)
            else:
                assert isinstance(msg, UnmaskShares)
                self.server.receive_unmask(msg)
        except SecAggError as exc:
            return str(exc)
        return None

    def masked(self, client: str, blob: bytes) -> str | None:
        """A device's masked input (its update blob in this round); the reason it is refused, or None."""
        if self.stage > 3:  # a slow honest device: acked late, no strike (coordinator.intake)
            return f"late: the secure round's unmasking began (stage {self.stage}); the survivors are named"
        if self.stage != 3:
            return f"a masked input in stage {self.stage} of the secure round"
        try:
            msg = decode_message(blob)
            if not isinstance(msg, MaskedInput) or msg.device != client:
                return "the update of a secure round must be the sender's masked input"
            self.server.receive_masked(msg)
        except SecAggError as exc:
            return str(exc)
        return None

    def advance(self, now: float, masked_done: bool = False) -> list[tuple[str, bytes]]:
        """Stage transitions due now: the messages to send, as (device, bytes). ``masked_done``: the round's
        timer ended stage 3. SecAggAbandoned when a stage closes with too few devices, or as soon as too few can
        still come: the survivor set must hold max(t, T) devices and T participants must sign it."""
        if self.refused is not None:
            raise SecAggAbandoned(self.refused)
        s, out, need = self.server, [], self.needed
        everyone = frozenset(self.participants) - frozenset(s.faulty)
        can_come = self._can_come()
        if self.stage in (1, 2, 3):  # the survivor set can only shrink from here: U1 >= U2 >= U3
            have = {1: s.advertised, 2: s.shared, 3: s.survivors}[self.stage]
            what = {1: "advertised keys", 2: "sent their shares", 3: "sent a masked input"}[self.stage]
            closing = masked_done if self.stage == 3 else (not can_come or now >= self.stage_end)
            if len(have) + (0 if closing else len(can_come)) < need:
                raise SecAggAbandoned(f"{len(have)} devices {what}{'' if closing else f' and {len(can_come)} more can'}"
                                      f", fewer than the {need} the unmasking needs (t={self.planned.params.threshold}, "
                                      f"T={need}): ended at once")
        if self.stage == 3:  # the shares each could reveal: even the largest survivor set that can come falls short
            later = frozenset() if masked_done else can_come
            short = s.shortfall(s.survivors | later, later)
            if short is not None:
                more = "" if masked_done else " even with every masked input that can still come"
                raise SecAggAbandoned(f"{short}{more}: ended at once")
        if self.stage == 1 and (not can_come or now >= self.stage_end):
            self._censor(1, now, can_come)
            out = [(d, s.key_bundle(d).to_bytes()) for d in sorted(s.advertised)]
            self._open_stage(2, now)
        elif self.stage == 2 and (not can_come or now >= self.stage_end):
            self._censor(2, now, can_come)
            out = [(d, s.shares_for(d).to_bytes()) for d in sorted(s.shared)]
            self.stage, self.opened = 3, now
        elif self.stage == 3 and masked_done:  # every device whose masked input arrived is asked for its consent
            out = [(d, s.consent_request(d).to_bytes()) for d in sorted(s.survivors - frozenset(s.faulty))]
            self._open_stage(4, now)
        elif self.stage == 4:  # the survivors: masked input and consent (the others are taken out of the sum)
            unasked = {d for d in s.survivors - s.consented - frozenset(s.faulty) if not self.gone(d)}
            if len(s.consented) + (0 if now >= self.stage_end else len(unasked)) < need:
                raise SecAggAbandoned(f"{len(s.consented)} devices consented and {len(unasked)} more can, fewer than "
                                      f"the {need} the unmasking needs: ended at once")
            if not unasked or now >= self.stage_end:  # every participant in good standing may sign (witnesses too)
                self._censor(4, now, unasked)
                self.asked = set(everyone)
                out = [(d, s.consistency_request(d).to_bytes()) for d in sorted(everyone)]
                self._open_stage(5, now)
        elif self.stage == 5:  # witnesses count towards T; the survivors' own signatures are waited for (each
            unsigned = {d for d in everyone - s.signed if not self.gone(d)}  # answers the unmasking only then)
            if len(s.signed) + (0 if now >= self.stage_end else len(unsigned)) < need:
                raise SecAggAbandoned(f"{len(s.signed)} devices signed the survivor set and {len(unsigned)} more "
                                      f"can, fewer than T={need}: ended at once")
            survivors_unsigned = unsigned & s.survivors
            if (len(s.signed) >= need and not survivors_unsigned) or now >= self.stage_end:
                self._censor(5, now, survivors_unsigned)
                out = [(d, s.unmask_request(d).to_bytes()) for d in sorted(s.survivors)]
                self._open_stage(6, now)
        self.sent_bytes += sum(len(b) for _, b in out)
        return out

    def _can_come(self) -> frozenset[str]:
        """The devices the current stage (keys, shares, masked inputs) still waits for that are not known offline:
        in good standing and yet to send what the stage asks."""
        s = self.server
        named = frozenset(s.faulty)
        waiting = {1: frozenset(self.participants) - named - s.advertised, 2: s.advertised - s.shared - named,
                   3: s.shared - s.survivors - named}.get(self.stage, frozenset())
        return frozenset(d for d in waiting if not self.gone(d))

    def held(self) -> str | None:
        """Why the masked inputs' stage stays open although the round's timer would end it at quorum and grace: the
        devices whose masked input arrived could not unmask the sum (:func:`flayer.secagg.outlook.shortfall`), and
        those that shared and are still online could complete it. None: close."""
        s = self.server
        short = s.shortfall(s.survivors) if self.stage == 3 else None
        if short is None:
            return None
        can_come = self._can_come()
        if not can_come or s.shortfall(s.survivors | can_come, can_come) is not None:
            return None
        return f"{short}; {len(can_come)} more that shared can still send a masked input"

    def _censor(self, stage: int, now: float, late: Collection[str]) -> None:
        """The devices still online that had not answered when the stage closed: latencies of at least its length."""
        if self.timing is not None and late:
            self.timing.censored(stage, now - self.stage_opened.get(stage, self.opened), len(late))

    def ask_late(self, device: str) -> list[tuple[str, bytes]]:
        """A participant heard from during the signing stage that was not asked yet (its plan came late): the
        survivor set to sign, while the round is open."""
        s = self.server
        if self.stage != 5 or device in self.asked or device in s.faulty or not self.planned.params.is_participant(device):
            return []
        self.asked.add(device)
        out = [(device, s.consistency_request(device).to_bytes())]
        self.sent_bytes += len(out[0][1])
        return out

    @property
    def consent_asked(self) -> bool:
        """A consent request went out: a device may have booked the round (edge_client.booking)."""
        return bool(self.server.consent is not None and self.server.consent.asked) or bool(self.server.asked)

    def unmask_done(self, now: float) -> bool:
        """The unmasking (stage 6) is over: every survivor answered, or its time is up, or every one still missing
        is known offline."""
        s = self.server
        missing = [d for d in s.survivors - s.responded if not self.gone(d)]
        return self.stage == 6 and (not missing or now >= self.stage_end)

    def finish(self, central: tuple[float, float] | None = None) -> SecureSum:
        """The round's sum, decoded and checked, or why it cannot be had (the model then stays as it was);
        ``central``: a central-DP round's noise, added before the checks (:func:`flayer.engine.secure.sum_update`)."""
        s = self.server
        survivors = tuple(sorted(s.survivors))
        dropped = tuple(sorted(set(self.participants) - s.survivors))
        try:
            ring_sum = s.result()
        except (SecAggAbandoned, SecAggError) as exc:
            return SecureSum(None, survivors, dropped, getattr(exc, "reason", None) or str(exc))
        total, bits, why = sum_update(ring_sum, self.planned, self.layout, len(survivors), central)
        return SecureSum(total, survivors, dropped, why, bits, noised=central is not None)

    def abandon_early(self, reason: str) -> SecureSum:
        return SecureSum(None, tuple(sorted(self.server.survivors)),
                         tuple(sorted(set(self.participants) - self.server.survivors)), reason)
