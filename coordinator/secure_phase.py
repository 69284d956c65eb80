"""The coordinator's secure rounds (``[privacy] secure_aggregation = true``; docs/explanation/secure-aggregation.md).

A part of :class:`coordinator.server.Coordinator` (``secure_phase``, built from a :class:`SecureContext`): it
opens a round's protocol beside the round (:class:`coordinator.secure_round.SecureRound`), takes the devices'
protocol messages from ``secagg/<client>``, sends each device its own on ``secreq/<client>``, moves the stages on
the worker thread's ticks, and at the end folds the unmasked sum -- the only update of a secure round the
coordinator ever holds -- or abandons the round with the reason (the model stays; the federation goes on with the
next round and new keys). It never closes a round itself: it returns the reason, and the round loop closes it
(:meth:`coordinator.cycle.RoundCycle.close`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flayer.engine.secure import SecureSum, abandon_kind, central_noise, plan_round, plan_secure
from flayer.engine.secure_fit import keep_layout
from flayer.engine.secure_layout import round_layout
from flayer.engine.secure_plan import failure_problem
from flayer.secagg import MaskedInput, SecAggAbandoned, SecAggError, decode_message
from flayer.secagg.graph import round_failure
from flayer.strategies.base import Strategy
from protocol import (
    Envelope,
    Kind,
    Metrics,
    Plan,
    SignatureError,
    Topics,
    WireError,
    check_topic,
    decode_envelope,
)
from protocol.limits import WireLimits
from protocol.plan_digest import plan_digest
from protocol.signing import SigningKey, advert_verifier, survivor_verifier
from protocol.topics import ParsedTopic
from transport.credentials import Credentials
from transport.link import MqttLink

from .config import CoordinatorConfig
from .device_certs import DeviceCerts
from .device_keys import DeviceKeys
from .inbox import Inbox
from .journal import JournalError, journal_key, journal_path, scan_updates
from .open_round import OpenRound
from .privacy import FederationPrivacy
from .registry import DeviceRegistry
from .secure_fit import round_keep
from .secure_round import SecureRound
from .secure_timing import StageTiming

__all__ = ["SecureContext", "SecurePhase", "secure_strategy"]

VOID_KEPT = 8  # the abandoned rounds a plan names (a device offline for longer keeps them booked: over, never under)
VOID_CHARS = 256  # the most a plan's string value holds (protocol.messages)

log = logging.getLogger("coordinator.server")


def journaled_masked(rnd: OpenRound, devices: Sequence[str]) -> Iterator[tuple[str, np.ndarray]]:
    """The masked inputs of ``devices`` in ``rnd``, one at a time, read back from the round's journal (every accepted
    update lies there): a masked input whose device gave no consent is taken out of the sum
    (flayer.secagg.server_consent). Each is its device's first record (the protocol takes one masked input a device),
    read alone where the open journal appended it (coordinator.journal: O(model) memory and reads each, whatever the
    round's size), or found in one streaming pass over the file for all ``devices`` when the journal is closed.
    SecAggError (the round is abandoned) when a record does not authenticate, or is not the device's masked input of
    this round; a device whose input is not found is left out (the caller names it)."""
    if rnd.journal is None and rnd.journal_dir is None:
        raise SecAggError(f"round {rnd.number} keeps no journal to read masked inputs back from")
    try:
        if rnd.journal is not None:
            records = rnd.journal.read_updates(devices)
        else:
            assert rnd.journal_dir is not None
            records = scan_updates(journal_path(rnd.journal_dir, rnd.number), journal_key(rnd.journal_dir), devices)
        for rec in records:
            msg = decode_message(rec.data)
            if not isinstance(msg, MaskedInput) or msg.device != rec.client or msg.round != rnd.number \
                    or rec.round != rnd.number:
                raise SecAggError(f"the journal record of {rec.client} in round {rnd.number} is not its masked input "
                                  f"of the round")
            yield rec.client, msg.vector
    except (JournalError, OSError) as exc:
        raise SecAggError(f"a masked input cannot be read back: {exc}") from None


def secure_strategy(strategy: Strategy) -> Strategy:
    """The strategy as secure rounds run it (public positions; CoordinatorError naming what cannot be)."""
    from flayer.engine.privacy import private_strategy

    from .result import CoordinatorError

    try:
        return private_strategy(strategy)
    except ValueError as exc:
        raise CoordinatorError(f"[privacy] secure_aggregation: {exc}") from None


@dataclass(frozen=True)
class SecureContext:
    """What the secure phase needs from the coordinator, given once at its construction."""

    cfg: CoordinatorConfig
    creds: Credentials
    clock: Callable[[], float]
    registry: DeviceRegistry  # the selected devices' uplink rates (coordinator.secure_fit)
    device_keys: DeviceKeys  # a device's messages are believed on its own key only
    inbox: Inbox  # refusals counted as for any message
    link: MqttLink  # each device's own messages, on secreq/<client>
    topics: Topics
    signer: SigningKey
    limits: WireLimits
    counters: Counter[str]
    privacy: FederationPrivacy | None
    device_certs: DeviceCerts | None = None  # the adverts' certificates (None: the key registry alone)


class SecurePhase:
    """Secure rounds at the coordinator (module docstring). It works on the round it is handed and keeps its
    own state: the devices a secure round proved faulty, the stage limits measured from the fleet, and the recent
    rounds abandoned before any consent request. When a round's protocol is over, :meth:`tick`,
    :meth:`on_message` and :meth:`close` return the reason the round closes with; the caller closes it."""

    def __init__(self, ctx: SecureContext) -> None:
        self.ctx = ctx
        # device -> the proof (a refused key, a false share): left out of every later round's selection, as a
        # device over its strikes is cut off; checkpointed with each round, so a restart keeps them out
        self.excluded: dict[str, str] = {}
        # each stage's limit from the fleet's measured latencies (coordinator.secure_timing), at most a third of the
        # round's deadline; and the recent rounds abandoned before any consent was asked, which the plan names so that
        # anyone holding the plans counts no selection in them toward max_participations (no device booked them:
        # edge_client.booking)
        privacy = ctx.cfg.run.privacy
        self.timing = StageTiming(privacy.secure_stage_s, max(privacy.secure_stage_s, ctx.cfg.federation.deadline_s / 3))
        self.void: list[tuple[int, str]] = []
        if self.enabled and ctx.privacy is None and ctx.cfg.federation.norm_bound is None:
            log.warning("secure rounds without DP and without [federation] norm_bound: no single update's norm is "
                        "ever seen, so the automatic bound stays at norm_auto x the model's own norm, and one "
                        "hostile device can move the model by about that much a round; set norm_bound "
                        "(docs/explanation/secure-aggregation.md)")

    @property
    def enabled(self) -> bool:
        return bool(self.ctx.cfg.run.privacy.secure_aggregation)

    def open(self, rnd: OpenRound, strategy: Strategy, global_state: Mapping[str, torch.Tensor],
             close_by: Callable[[float, float], float]) -> None:
        """Give the round just begun its protocol: the common layout, the public parameters, a fresh session
        (``close_by``: the plan's expected close for a round opened at a time with a deadline, 0: none)."""
        c = self.ctx
        s = c.cfg.run.privacy
        fs = c.cfg.federation
        selected = tuple(sorted(rnd.selected))
        layout = round_layout(strategy, global_state, rnd.number, c.cfg.run.seed)
        session = f"{c.creds.federation}.{rnd.number}.{secrets.token_hex(8)}"
        private = rnd.aggregate.privacy
        if private is not None and private.mode == "local":  # distributed DP: the shares are drawn in the ring
            private = rnd.aggregate.privacy = dataclasses.replace(private, ring=True)
        planned = plan_round(s, session, rnd.number, selected, layout, c.cfg.run.seed, private,
                             rnd.ctx.bounds.norm_bound, keep=s.secure_keep)
        now = c.clock()  # the masked inputs' keep fraction, fitted to the selected devices' uplinks
        close = close_by(now, now + fs.deadline_s) or now + fs.deadline_s
        keep, budget = round_keep(s, fs, c.creds.federation, c.registry, selected, layout, planned.params.ring.bits,
                                  planned.params.degree, close - now)
        if keep != planned.keep:
            planned = plan_round(s, session, rnd.number, selected, layout, c.cfg.run.seed, private,
                                 rnd.ctx.bounds.norm_bound, keep=keep)
        layout = keep_layout(layout, keep, c.cfg.run.seed, rnd.number)
        rnd.stats.extra.update({"secure_keep": keep, "secure_budget": budget})
        params = planned.params
        fed = c.creds.federation
        self.timing.new_round()
        certs = c.device_certs.for_round(c.device_keys) if c.device_certs is not None else None
        keys = certs if certs is not None else c.device_keys  # each advert's certificate, or the key registry
        sec = rnd.secure = SecureRound(planned, layout, c.clock() + self.timing.limit(1),
                                       verify=survivor_verifier(keys, fed, rnd.number),
                                       verify_advert=advert_verifier(keys, fed, rnd.number), timing=self.timing,
                                       gone=lambda device: not c.registry.is_online(device, c.clock()), certs=certs,
                                       recall=lambda devices: journaled_masked(rnd, devices))
        rnd.stats.extra["secure_stage_limits"] = self.timing.limits()
        need = sec.needed
        fail = round_failure(len(selected), params.degree, params.threshold, need, planned.dropout)
        rnd.stats.extra["secure_failure"] = float(f"{fail:.3g}")
        sec.refused = failure_problem(len(selected), params.degree, params.threshold, planned.dropout,
                                      planned.corrupt_fraction)
        if sec.refused is not None:
            log.warning("round %d: secure round %s", rnd.number, sec.refused)
        rnd.ctx = dataclasses.replace(rnd.ctx, masked=sec.masked)
        log.info("round %d: secure aggregation over %d devices, t = %d, %d neighbours each, %d coordinates, "
                 "contributions clipped to L2 %.4g, keep %.4g (budget %d bytes)", rnd.number, len(selected),
                 params.threshold, params.degree, params.length, planned.bound, keep, budget)

    def plan(self, rnd: OpenRound | None) -> dict[str, Any]:
        """The plan's ``secure`` mapping of ``rnd`` (empty: not a secure round)."""
        sec = rnd.secure if rnd is not None else None
        if sec is None:
            return {}
        void = [session for _, session in self.void]  # a plan's values are scalars: the sessions, space-separated
        while len(" ".join(void)) > VOID_CHARS:
            void = void[1:]
        return {**plan_secure(sec.planned), "void": " ".join(void)}

    def bind(self, rnd: OpenRound | None, plan: Plan) -> None:
        """Bind the open secure round's transcript to ``plan``, the round plan as the devices read it: every field
        a device's input depends on (:mod:`protocol.plan_digest`). Called on each plan built, before it goes out."""
        if rnd is not None and rnd.secure is not None and not rnd.secure.bind(plan_digest(plan)):
            log.error("round %d: the plan published again differs from the first in a field the secure round binds; "
                      "devices that read different ones verify nothing of each other", rnd.number)

    def on_message(self, rnd: OpenRound | None, client: str, parsed: ParsedTopic, payload: bytes) -> str | None:
        """A device's protocol message: checked, handed to the round's protocol, stages moved on (returns the
        reason ``rnd`` closes with, when its protocol is over)."""
        inbox = self.ctx.inbox
        try:
            env = decode_envelope(payload, self.ctx.limits, self.ctx.device_keys)  # the device's own key
            check_topic(env, parsed)
        except SignatureError as exc:
            inbox.count("unsigned", f"secure-round message under {client}: {exc.reason}", client)
            return None
        except WireError as exc:
            inbox.count("bad_message", f"secure-round message from {client}: {exc.reason}", client)
            return None
        if rnd is None or rnd.secure is None or env.round != rnd.number:
            inbox.count("late", f"secure-round message of round {env.round} from {client}: no such secure round "
                                     f"open", client)
            return None
        if client not in rnd.selected:
            inbox.count("not_selected", f"secure-round message from {client}, not selected", client)
            return None
        now = self.ctx.clock()
        self._send(rnd, rnd.secure.ask_late(client))  # heard from while the survivor set is signed: it may sign
        why = rnd.secure.receive(client, env.body, now)
        if why is not None:
            inbox.count("secure", f"{client} round {env.round}: {why}", client)
            return None
        return self.tick(rnd, now)

    def metrics(self, rnd: OpenRound | None, client: str, msg: Metrics) -> bool:
        """A secure round's evaluation report (the counts the round record shows, outside the masked sum)."""
        if rnd is None or rnd.secure is None or msg.round != rnd.number or client not in rnd.selected \
                or client in rnd.evals:
            return False
        rnd.evals.add(client)
        if rnd.aggregate.privacy is not None:  # a private round records no device's evaluation (an earlier
            return True  # release's device may still send one: taken, not recorded)
        rnd.aggregate.tally.add_eval({k: v for k, v in msg.values.items()
                                      if k in ("test_correct", "test_total", "train_loss")}, client)
        return True

    def _send(self, rnd: OpenRound, messages: list[tuple[str, bytes]]) -> None:
        c = self.ctx
        for device, body in messages:
            env = Envelope(Kind.SECAGG, c.creds.federation, c.creds.username, rnd.number, 0, 1, len(body),
                           hashlib.sha256(body).hexdigest(), body)
            payload = env.encode(c.signer)
            c.link.publish(c.topics.secreq(device), payload)
            rnd.stats.bytes_out += len(payload)

    def tick(self, rnd: OpenRound, now: float, closing: str | None = None) -> str | None:
        """Move the round's protocol on: key bundles, shares, the unmask requests once the round's timer ends
        the masked inputs' stage (``closing``: its reason, decided by the coordinator's tick as for a plain
        round), and the sum when the unmasking is over (or abandon the round). Returns the reason the round
        closes with once its protocol is over (None: not yet)."""
        sec = rnd.secure
        assert sec is not None
        try:
            if sec.stage in (1, 2) or (sec.stage == 3 and closing is None):  # stage 3: ended once too few can come
                self._send(rnd, sec.advance(now))
            if sec.stage == 3 and closing is not None:
                deadline = rnd.timer.deadline if rnd.timer is not None else now
                held = sec.held() if now < deadline else None
                if held is not None:  # quorum and grace, on masked inputs that could not be unmasked: wait on
                    if sec.held_until is None:
                        log.warning("round %d: the masked inputs' stage stays open past quorum and grace: %s",
                                    rnd.number, held)
                        rnd.stats.extra["secure_held"] = held
                    sec.held_until = deadline
                    return None
                rnd.stats.extra["secure_closed"] = closing
                self._send(rnd, sec.advance(now, masked_done=True))
            if sec.stage == 4:  # the consents: the survivor set once the survivors consented
                self._send(rnd, sec.advance(now))
            if sec.stage == 5:  # the consistency round: the unmask requests once the survivors signed
                self._send(rnd, sec.advance(now))
            if sec.stage == 6 and sec.unmask_done(now):
                return self.close(rnd, sec.finish(central_noise(rnd.aggregate.privacy)))
        except SecAggAbandoned as exc:
            return self.close(rnd, sec.abandon_early(exc.reason))
        return None

    def close(self, rnd: OpenRound, out: SecureSum) -> str:
        """Fold the round's unmasked sum (or nothing: abandoned); returns the reason the round closes with."""
        sec = rnd.secure
        assert sec is not None
        if out.update is not None:
            rnd.aggregate.fold_sum(out.update, len(out.survivors), out.bits, out.noised)
        else:
            log.warning("round %d: secure round abandoned: %s; the model stays as it was", rnd.number, out.reason)
            if not sec.consent_asked:  # no consent asked: no device booked the round, none's input can be revealed
                self.void = [*self.void, (rnd.number, sec.planned.params.session)][-VOID_KEPT:]
                if self.ctx.privacy is not None:  # the schema counts its selections toward no device's k
                    self.ctx.privacy.abandoned(rnd.number)
            self.ctx.counters["secure_abandoned"] += 1
            private = rnd.aggregate.privacy
            if abandon_kind(out.reason) == "sum_check" and private is not None and self.ctx.privacy is not None:
                self.ctx.privacy.accounts.unmasked_unfolded(private)  # the sum was unmasked, then refused
        faulty = dict(sec.server.faulty)
        for device, proof in sorted(faulty.items()):
            if device not in self.excluded:
                log.warning("round %d: %s is left out of later rounds: %s", rnd.number, device, proof)
            self.excluded[device] = proof
        rnd.stats.extra.update({"secure_survivors": list(out.survivors), "secure_dropped": list(out.dropped),
                                "secure_abandoned": out.reason, "secure_abandoned_kind": abandon_kind(out.reason),
                                "secure_faulty": faulty, "secure_bytes_out": sec.sent_bytes})
        return str(rnd.stats.extra.get("secure_closed") or ("abandoned" if out.update is None else "secure"))
