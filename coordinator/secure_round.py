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
   (quorum and grace, or the deadline).
4. **Consistency.** Each survivor gets the whole survivor set (``ConsistencyRequest``) and signs it with its own
   key (``SurvivorSignature``, checked against the federation's registry); when all have, or the stage's time is up,
   the signatures travel on in the unmask requests (fewer than T abandon the round: :mod:`flayer.secagg.consistency`).
5. **Unmasking.** Each survivor gets its ``UnmaskRequest``; when all answered, or the stage's time is up, the
   sum is rebuilt (:meth:`SecureRound.finish`): decoded, checked against what ``count`` clipped uploads can
   reach, and folded. Too few survivors or shares abandon the round with the reason; the model stays.

A refused protocol message (out of stage, from a device not selected, forged, a second answer) changes
nothing and is counted. A restarted coordinator never resumes a secure round: the devices' keys and shares
lived in memory only, so a journaled secure round is abandoned and the next one starts with new keys
(:mod:`coordinator.phases`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from flayer.engine.secure import PlannedSecure, SecureSum, sum_update
from flayer.engine.secure_layout import Layout
from flayer.secagg import (
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
from flayer.secagg.signed_adverts import AdvertSignatureError

__all__ = ["SecureRound"]

log = logging.getLogger(__name__)

_STAGE_MESSAGE = {1: KeyAdvert, 2: ShareBatch, 3: ShareComplaint, 4: SurvivorSignature, 5: UnmaskShares}


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

    def __post_init__(self) -> None:
        self.server = SecAggServer(self.planned.params, ServerConsistency(self.verify, self.planned.corrupt_fraction,
                                                                          self.verify_advert))

    @property
    def participants(self) -> tuple[str, ...]:
        return self.planned.params.participants

    def receive(self, client: str, body: bytes) -> str | None:
        """A device's protocol message (keys, shares, unmasking shares); the reason it is refused, or None."""
        try:
            msg = decode_message(body)
        except SecAggError as exc:
            return f"malformed secure-round message: {exc}"
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
                    self.server.name_faulty(client, f"{client} signed its key advert falsely: {exc}")
                    raise
            elif isinstance(msg, ShareBatch):
                try:
                    self.server.receive_shares(msg)
                except AdvertSignatureError as exc:  # a share its sender did not sign, in the sender's envelope
                    self.server.name_faulty(client, f"{client} signed its sealed shares falsely: {exc}")
                    raise
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
        timer ended stage 3. SecAggAbandoned when a stage closes with too few devices."""
        s, out = self.server, []
        stage_s, t = self.planned.stage_s, self.planned.params.threshold
        for stage, members, what in ((1, s.advertised, "advertised keys"), (2, s.shared, "sent their shares"),
                                     (3, s.survivors, "sent a masked input")):
            closing = {1: s.advertised == frozenset(self.participants) or now >= self.stage_end,
                       2: s.shared == s.advertised or now >= self.stage_end, 3: masked_done}[stage]
            if self.stage == stage and closing and len(members) < t:
                raise SecAggAbandoned(f"{len(members)} devices {what}, fewer than t={t}")
        if self.stage == 1 and (s.advertised == frozenset(self.participants) or now >= self.stage_end):
            out = [(d, s.key_bundle(d).to_bytes()) for d in sorted(s.advertised)]
            self.stage, self.stage_end = 2, now + stage_s
        elif self.stage == 2 and (s.shared == s.advertised or now >= self.stage_end):
            out = [(d, s.shares_for(d).to_bytes()) for d in sorted(s.shared)]
            self.stage = 3
        elif self.stage == 3 and masked_done:
            out = [(d, s.consistency_request(d).to_bytes()) for d in sorted(s.survivors)]
            self.stage, self.stage_end = 4, now + stage_s
        elif self.stage == 4 and (s.signed == s.survivors or now >= self.stage_end):
            out = [(d, s.unmask_request(d).to_bytes()) for d in sorted(s.survivors)]
            self.stage, self.stage_end = 5, now + stage_s
        self.sent_bytes += sum(len(b) for _, b in out)
        return out

    def unmask_done(self, now: float) -> bool:
        """The unmasking (stage 5) is over: every survivor answered, or its time is up."""
        return self.stage == 5 and (self.server.responded == self.server.survivors or now >= self.stage_end)

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
