"""What the coordinator publishes: the global model (retained chunks, and the delta from the previous model
with thin links) and the round plan, built from the federation's progress and the round open now.

:class:`Publishing` owns the publisher (:class:`coordinator.publish.Publisher`), the delta chain
(:class:`coordinator.deltas.DeltaChain`) and the chunk count of the model published last; it reads
:class:`coordinator.state.Progress`, asks the secure phase for a secure round's plan fields, and is handed the
open round (or the calibration) with each call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from flayer.engine.privacy import RoundPrivacy
from protocol import Plan

from .calibration import Calibration
from .config import CoordinatorConfig
from .deltas import DeltaChain
from .open_round import OpenRound
from .privacy import FederationPrivacy
from .publish import Publisher, make_plan
from .secure_phase import SecurePhase
from .state import Progress

__all__ = ["Publishing"]

log = logging.getLogger("coordinator.server")


class Publishing:
    """The model and plan publications (module docstring)."""

    def __init__(self, cfg: CoordinatorConfig, publisher: Publisher, deltas: DeltaChain, progress: Progress,
                 privacy: FederationPrivacy | None, secure: SecurePhase, clock: Callable[[], float]) -> None:
        self.cfg, self.fs = cfg, cfg.federation
        self.publisher, self.deltas, self.progress = publisher, deltas, progress
        self.privacy, self.secure, self.clock = privacy, secure, clock
        self.chunks = 0  # of the model published last

    def plan(self, phase: str, rnd: OpenRound | None, cal: Calibration | None = None) -> Plan:
        """The plan of ``rnd`` (else of the calibration ``cal``, else the final plan)."""
        model = self.progress.current_model()
        assert self.chunks > 0
        if rnd is not None:
            number, selected, deadline = rnd.number, rnd.selected, rnd.timer.deadline if rnd.timer else self.clock()
        elif cal is not None:
            number, selected, deadline = 0, cal.selected, cal.deadline
        else:
            number, selected, deadline = self.cfg.run.rounds + 1, frozenset(), self.clock()
        plan = make_plan(self.cfg, self.progress.strategy.name, self.progress.options, number, selected, deadline,
                         model, self.chunks, phase)
        close_by = self.progress.close_by(self.fs, rnd.stats.opened_at, deadline, rnd.number >= self.cfg.run.rounds) \
            if rnd is not None and rnd.timer else 0.0
        private = rnd.aggregate.privacy if rnd is not None else None
        plan = dataclasses.replace(plan, delta=self.deltas.plan_field(model.digest),  # thin links
                                   delta_chain=self.deltas.chain_field(model.digest), close_by=close_by,
                                   privacy=self._plan_privacy(private), secure=self.secure.plan(rnd))
        self.secure.bind(rnd, plan)  # the secure round's transcript covers the plan the devices read
        return plan

    def _plan_privacy(self, private: RoundPrivacy | None) -> dict[str, Any]:
        """A private round's plan mapping: its parameters, the delta epsilon is counted at and the devices'
        budget, with which each device counts and enforces its own epsilon (edge_client.budget)."""
        if private is None or self.privacy is None:
            return {}
        s = self.privacy.settings
        out = {**private.as_plan(), "delta": float(self.privacy.delta)}
        if s.device_budget is not None:
            out["device_budget"] = float(s.device_budget)
        if s.schema.active:  # the participation schema, signed with the plan: each device checks it (edge_client.budget)
            out.update(s.schema.as_plan())
        return out

    def model(self, round_: int, rnd: OpenRound | None) -> None:
        """The global model as round ``round_``'s (its bytes counted in ``rnd``'s metrics)."""
        model = self.progress.current_model()
        self.chunks, nbytes = self.publisher.model(model, round_)
        nbytes += self.deltas.publish(self.publisher, model, round_)  # thin links: the delta beside it
        if rnd is not None:
            rnd.stats.bytes_out += nbytes
            rnd.stats.model_bytes = model.size

    def publish_plan(self, phase: str, rnd: OpenRound | None, cal: Calibration | None = None) -> None:
        nbytes = self.publisher.plan(self.plan(phase, rnd, cal))
        if rnd is not None:
            rnd.stats.bytes_out += nbytes

    def republish(self, rnd: OpenRound | None, cal: Calibration | None) -> None:
        """After a reconnect: the broker may have restarted without the retained model and plan (Mosquitto
        saves them every ``autosave_interval``), and devices that missed them would wait forever."""
        if (rnd is None or rnd.timer is None) and cal is None:
            return
        self.publisher.forget()
        self.model(rnd.number if rnd is not None else 0, rnd)
        self.publish_plan("train" if rnd is not None else "calibrate", rnd, cal)
        log.info("published the model and plan again after the reconnect")
