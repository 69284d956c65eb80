"""The coordinator's secure rounds (``[privacy] secure_aggregation = true``; docs/explanation/secure-aggregation.md).

A component :class:`coordinator.server.Coordinator` holds (``secure_phase``): it opens a round's protocol beside the round
(:class:`coordinator.secure_round.SecureRound`), takes the devices' protocol messages from ``secagg/<client>``,
sends each device its own on ``secreq/<client>``, moves the stages on the worker thread's ticks, and at the
end folds the unmasked sum -- the only update of a secure round the coordinator ever holds -- or abandons
the round with the reason (the model stays; the federation goes on with the next round and new keys).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
from typing import Any

from flayer.engine.secure import abandon_kind, central_noise, plan_round, plan_secure
from flayer.engine.secure_fit import keep_layout
from flayer.engine.secure_layout import round_layout
from flayer.engine.secure_plan import failure_problem
from flayer.secagg import SecAggAbandoned
from flayer.secagg.graph import round_failure
from protocol import Envelope, Kind, Metrics, SignatureError, WireError, check_topic, decode_envelope
from protocol.plan_digest import plan_digest
from protocol.signing import advert_verifier, survivor_verifier

from .secure_fit import round_keep
from .secure_round import SecureRound
from .secure_timing import StageTiming

__all__ = ["SecurePhase", "secure_strategy"]

VOID_KEPT = 8  # the abandoned rounds a plan names (a device offline for longer keeps them booked: over, never under)
VOID_CHARS = 256  # the most a plan's string value holds (protocol.messages)

log = logging.getLogger("coordinator.server")


def secure_strategy(strategy: Any) -> Any:
    """The strategy as secure rounds run it (public positions; CoordinatorError naming what cannot be)."""
    from flayer.engine.privacy import private_strategy

    from .result import CoordinatorError

    try:
        return private_strategy(strategy)
    except ValueError as exc:
        raise CoordinatorError(f"[privacy] secure_aggregation: {exc}") from None


class SecurePhase:
    """Secure rounds at the coordinator, a component the coordinator holds (``coord.secure_phase``; module
    docstring). It reads and writes the coordinator's round state through ``coord`` and keeps its own: the
    devices a secure round proved faulty."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord
        # device -> the proof (a refused key, a false share): left out of every later round's selection, as a
        # device over its strikes is cut off; checkpointed with each round, so a restart keeps them out
        self.excluded: dict[str, str] = {}
        # each stage's limit from the fleet's measured latencies (coordinator.secure_timing), at most a third of the
        # round's deadline; and the recent rounds abandoned before any unmask request went out, which the plan names
        # so that the devices that booked them provisionally take them back (edge_client.secure)
        privacy = coord.cfg.run.privacy
        self.timing = StageTiming(privacy.secure_stage_s, max(privacy.secure_stage_s, coord.fs.deadline_s / 3))
        self.void: list[tuple[int, str]] = []
        if self.enabled and getattr(coord, "privacy", None) is None and coord.fs.norm_bound is None:
            log.warning("secure rounds without DP and without [federation] norm_bound: no single update's norm is "
                        "ever seen, so the automatic bound stays at norm_auto x the model's own norm, and one "
                        "hostile device can move the model by about that much a round; set norm_bound "
                        "(docs/explanation/secure-aggregation.md)")

    @property
    def enabled(self) -> bool:
        return bool(self.coord.cfg.run.privacy.secure_aggregation)

    def open(self, rnd: Any) -> None:
        """Give the round just begun its protocol: the common layout, the public parameters, a fresh session."""
        c = self.coord
        s = c.cfg.run.privacy
        selected = tuple(sorted(rnd.selected))
        layout = round_layout(c.strategy, c.global_state, rnd.number, c.cfg.run.seed)
        session = f"{c.creds.federation}.{rnd.number}.{secrets.token_hex(8)}"
        private = rnd.aggregate.privacy
        if private is not None and private.mode == "local":  # distributed DP: the shares are drawn in the ring
            private = rnd.aggregate.privacy = dataclasses.replace(private, ring=True)
        planned = plan_round(s, session, rnd.number, selected, layout, c.cfg.run.seed, private,
                             rnd.ctx.bounds.norm_bound, keep=s.secure_keep)
        now = c.clock()  # the masked inputs' keep fraction, fitted to the selected devices' uplinks
        close = (c._close_by(now, now + c.fs.deadline_s) if hasattr(c, "_close_by") else 0.0) or now + c.fs.deadline_s
        keep, budget = round_keep(c, selected, layout, planned.params.ring.bits, planned.params.degree, close - now)
        if keep != planned.keep:
            planned = plan_round(s, session, rnd.number, selected, layout, c.cfg.run.seed, private,
                                 rnd.ctx.bounds.norm_bound, keep=keep)
        layout = keep_layout(layout, keep, c.cfg.run.seed, rnd.number)
        rnd.stats.extra.update({"secure_keep": keep, "secure_budget": budget})
        params = planned.params
        fed = c.creds.federation
        self.timing.new_round()
        certs = c.device_certs.for_round(c.device_keys) if getattr(c, "device_certs", None) is not None else None
        keys = certs if certs is not None else c.device_keys  # each advert's certificate, or the key registry
        rnd.secure = SecureRound(planned, layout, c.clock() + self.timing.limit(1),
                                 verify=survivor_verifier(keys, fed, rnd.number),
                                 verify_advert=advert_verifier(keys, fed, rnd.number), timing=self.timing,
                                 gone=lambda device: not c.registry.is_online(device, c.clock()), certs=certs)
        rnd.stats.extra["secure_stage_limits"] = self.timing.limits()
        need = rnd.secure.needed
        fail = round_failure(len(selected), params.degree, params.threshold, need, planned.dropout)
        rnd.stats.extra["secure_failure"] = float(f"{fail:.3g}")
        rnd.secure.refused = failure_problem(len(selected), params.degree, params.threshold, planned.dropout,
                                             planned.corrupt_fraction)
        if rnd.secure.refused is not None:
            log.warning("round %d: secure round %s", rnd.number, rnd.secure.refused)
        rnd.ctx = dataclasses.replace(rnd.ctx, masked=rnd.secure.masked)
        log.info("round %d: secure aggregation over %d devices, t = %d, %d neighbours each, %d coordinates, "
                 "contributions clipped to L2 %.4g, keep %.4g (budget %d bytes)", rnd.number, len(selected),
                 params.threshold, params.degree, params.length, planned.bound, keep, budget)

    def plan(self, rnd: Any) -> dict[str, Any]:
        sec = rnd.secure if rnd is not None else None
        if sec is None:
            return {}
        void = [session for _, session in self.void]  # a plan's values are scalars: the sessions, space-separated
        while len(" ".join(void)) > VOID_CHARS:
            void = void[1:]
        return {**plan_secure(sec.planned), "void": " ".join(void)}

    def bind(self, rnd: Any, plan: Any) -> None:
        """Bind the open secure round's transcript to ``plan``, the round plan as the devices read it: every field
        a device's input depends on (:mod:`protocol.plan_digest`). Called on each plan built, before it goes out."""
        if rnd is not None and rnd.secure is not None and not rnd.secure.bind(plan_digest(plan)):
            log.error("round %d: the plan published again differs from the first in a field the secure round binds; "
                      "devices that read different ones verify nothing of each other", rnd.number)

    def on_message(self, client: str, parsed: Any, payload: bytes) -> None:
        """A device's protocol message: checked, handed to the round's protocol, stages moved on."""
        rnd, inbox = self.coord.open, self.coord.inbox
        try:
            env = decode_envelope(payload, self.coord.limits, self.coord.device_keys)  # the device's own key
            check_topic(env, parsed)
        except SignatureError as exc:
            inbox.count("unsigned", f"secure-round message under {client}: {exc.reason}", client)
            return
        except WireError as exc:
            inbox.count("bad_message", f"secure-round message from {client}: {exc.reason}", client)
            return
        if rnd is None or rnd.secure is None or env.round != rnd.number:
            inbox.count("late", f"secure-round message of round {env.round} from {client}: no such secure round "
                                     f"open", client)
            return
        if client not in rnd.selected:
            inbox.count("not_selected", f"secure-round message from {client}, not selected", client)
            return
        now = self.coord.clock()
        self._send(rnd, rnd.secure.ask_late(client))  # heard from while the survivor set is signed: it may sign
        why = rnd.secure.receive(client, env.body, now)
        if why is not None:
            inbox.count("secure", f"{client} round {env.round}: {why}", client)
            return
        self.tick(rnd, now)

    def metrics(self, client: str, msg: Metrics) -> bool:
        """A secure round's evaluation report (the counts the round record shows, outside the masked sum)."""
        rnd = self.coord.open
        if rnd is None or rnd.secure is None or msg.round != rnd.number or client not in rnd.selected \
                or client in rnd.evals:
            return False
        rnd.evals.add(client)
        if rnd.aggregate.privacy is not None:  # a private round records no device's evaluation (an earlier
            return True  # release's device may still send one: taken, not recorded)
        rnd.aggregate.tally.add_eval({k: v for k, v in msg.values.items()
                                      if k in ("test_correct", "test_total", "train_loss")}, client)
        return True

    def _send(self, rnd: Any, messages: list[tuple[str, bytes]]) -> None:
        c = self.coord
        for device, body in messages:
            env = Envelope(Kind.SECAGG, c.creds.federation, c.creds.username, rnd.number, 0, 1, len(body),
                           hashlib.sha256(body).hexdigest(), body)
            payload = env.encode(c.signer)
            c.link.publish(c.topics.secreq(device), payload)
            rnd.stats.bytes_out += len(payload)

    def tick(self, rnd: Any, now: float, closing: str | None = None) -> None:
        """Move the round's protocol on: key bundles, shares, the unmask requests once the round's timer ends
        the masked inputs' stage (``closing``: its reason, decided by the coordinator's tick as for a plain
        round), and the sum when the unmasking is over (or abandon the round)."""
        sec = rnd.secure
        try:
            if sec.stage in (1, 2) or (sec.stage == 3 and closing is None):  # stage 3: ended once too few can come
                self._send(rnd, sec.advance(now))
            if sec.stage == 3 and closing is not None:
                rnd.stats.extra["secure_closed"] = closing
                self._send(rnd, sec.advance(now, masked_done=True))
            if sec.stage == 4:  # the consistency round: the unmask requests once the survivors signed
                self._send(rnd, sec.advance(now))
            if sec.stage == 5 and sec.unmask_done(now):
                self.close(rnd, sec.finish(central_noise(rnd.aggregate.privacy)))
        except SecAggAbandoned as exc:
            self.close(rnd, sec.abandon_early(exc.reason))

    def close(self, rnd: Any, out: Any) -> None:
        """Fold the round's unmasked sum (or nothing: abandoned) and close the round."""
        if out.update is not None:
            rnd.aggregate.fold_sum(out.update, len(out.survivors), out.bits, out.noised)
        else:
            log.warning("round %d: secure round abandoned: %s; the model stays as it was", rnd.number, out.reason)
            if not rnd.secure.server.asked:  # no unmask request went out: no device's input can have been revealed
                self.void = [*self.void, (rnd.number, rnd.secure.planned.params.session)][-VOID_KEPT:]
                if self.coord.privacy is not None:  # the schema counts its selections toward no device's k
                    self.coord.privacy.abandoned(rnd.number)
            self.coord.counters["secure_abandoned"] += 1
            private = rnd.aggregate.privacy
            if abandon_kind(out.reason) == "sum_check" and private is not None and self.coord.privacy is not None:
                self.coord.privacy.accounts.unmasked_unfolded(private)  # the sum was unmasked, then refused
        faulty = dict(rnd.secure.server.faulty)
        for device, proof in sorted(faulty.items()):
            if device not in self.excluded:
                log.warning("round %d: %s is left out of later rounds: %s", rnd.number, device, proof)
            self.excluded[device] = proof
        rnd.stats.extra.update({"secure_survivors": list(out.survivors), "secure_dropped": list(out.dropped),
                                "secure_abandoned": out.reason, "secure_abandoned_kind": abandon_kind(out.reason),
                                "secure_faulty": faulty, "secure_bytes_out": rnd.secure.sent_bytes})
        self.coord._close_round(rnd.stats.extra.get("secure_closed") or ("abandoned" if out.update is None else "secure"))
