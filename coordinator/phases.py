"""The coordinator's publishing side and its phases outside a training round: the start (the
checkpoint and the journal of an interrupted round), the round plan, the model and plan publications
(and their re-publication after a reconnect), round 0 (calibration) and the end of the federation.
A mixin of :class:`coordinator.server.Coordinator`, which holds the state."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any

from flayer.engine import VersionWindow, initial_global_state
from flayer.state import load_initial_model, save_model
from flayer.strategies import make_strategy
from protocol import Plan

from .calibration import Calibration, CalibrationError
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .open_round import folded_in, journaled_round, journaled_selection
from .publish import make_plan, model_blob
from .result import CoordinatorError

__all__ = ["Phases"]

log = logging.getLogger("coordinator.server")


class Phases:
    """The start, publishing, calibration and the finish (see module docstring)."""

    cfg: Any
    fs: Any
    model: Any
    open: Any
    calibration: Any
    publisher: Any
    strategy: Any
    options: dict[str, Any]
    on_progress: Any
    _chunks: int
    deltas: Any
    durations: list[float]  # of the recent rounds (coordinator.server)
    creds: Any
    limits: Any
    counters: Any
    norms: Any
    quarantine: Any
    window: Any  # VersionWindow | None (asynchronous rounds)
    asynchronous: bool
    journal_dir: Any
    done_round: int
    global_state: dict[str, Any]
    accepted_before: dict[int, set[str]]
    _resumed: bool
    _calibrated: bool

    def _begin(self, number: int, selected: Any) -> Any: ...  # coordinator.server

    # ---- start-up: checkpoint and journal -------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        ident = {"federation": self.creds.federation, "strategy": self.cfg.run.strategy, "seed": self.cfg.run.seed,
                 "options": dict(self.cfg.options), "train": self.cfg.train_plan,
                 "model": dataclasses.asdict(self.cfg.spec)}
        return {**ident, "mode": "async"} if self.asynchronous else ident

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.cfg.state_dir, self.identity())
        if ckpt is None and self.cfg.initial_model is not None:
            self.global_state = load_initial_model(self.cfg.initial_model, self.strategy.new_model())
            log.info("first global model from %s", self.cfg.initial_model)
        elif ckpt is None:
            self.global_state = initial_global_state(self.strategy, self.cfg.run.seed)
        else:
            self.done_round, self.global_state = ckpt.round, ckpt.global_state
            self.counters.update(ckpt.counters)
            self.norms.add(ckpt.norms)
            if self.window is not None and ckpt.window:
                try:
                    self.window = VersionWindow.from_dict(self.fs.max_staleness, ckpt.window)
                except (TypeError, ValueError, AttributeError) as exc:
                    raise CheckpointError(f"checkpoint in {self.cfg.state_dir}: unreadable version window ({exc})") \
                        from None
            self._calibrated = True  # a checkpoint exists only after a calibration (if any)
            if ckpt.options != self.options:  # options a calibration resolved
                self.options = ckpt.options
                self.strategy = make_strategy(self.cfg.run.strategy, self.cfg.spec, self.cfg.run.train, ckpt.options)
            log.info("resuming after round %d from %s", ckpt.round, self.cfg.state_dir)
        self.model = model_blob(self.global_state)
        if ckpt is not None and ckpt.model_digest not in ("", self.model.digest):
            raise CoordinatorError(f"checkpoint in {self.cfg.state_dir} does not match its recorded digest")
        self.accepted_before = folded_in(self.journal_dir, range(max(1, self.done_round - 2), self.done_round + 1))
        if self.done_round >= self.cfg.run.rounds:
            return
        try:
            found = journaled_round(self.journal_dir, self.done_round + 1, self.limits, self.model.digest)
        except RuntimeError as exc:
            raise CoordinatorError(str(exc)) from None
        if found is not None:
            plan, replay = found
            self.open = self._begin(plan.round, plan.selected)
            if self.window is not None:  # every device a plan of this version offered a slot
                self.window.offer(journaled_selection(replay, self.limits))
            self._resumed = True
            log.info("replayed %d journaled update(s) of round %d", self.open.replay(replay, self.quarantine),
                     plan.round)
            self.open.open_journal(self.journal_dir)  # cuts a torn tail; re-sent updates may arrive at once

    # ---- publishing ----------------------------------------------------------------------------

    def _plan(self, phase: str = "train") -> Plan:
        assert self.model is not None and self._chunks > 0
        rnd, cal = self.open, self.calibration
        if rnd is not None:
            number, selected, deadline = rnd.number, rnd.selected, rnd.timer.deadline if rnd.timer else self.clock()
        elif cal is not None:
            number, selected, deadline = 0, cal.selected, cal.deadline
        else:
            number, selected, deadline = self.cfg.run.rounds + 1, frozenset(), self.clock()
        plan = make_plan(self.cfg, self.strategy.name, self.options, number, selected, deadline, self.model,
                         self._chunks, phase)
        close_by = self._close_by(rnd.stats.opened_at, deadline) if rnd is not None and rnd.timer else 0.0
        return dataclasses.replace(plan, delta=self.deltas.plan_field(self.model.digest),  # thin links
                                   delta_chain=self.deltas.chain_field(self.model.digest), close_by=close_by)

    def _close_by(self, opened_at: float, deadline: float) -> float:
        """When an update of the open round should have arrived to count, from the median length of the
        recent rounds (0: no history yet). Synchronous: the round's expected close, at most its deadline;
        asynchronous: ``max_staleness + 1`` versions after this one opened. Devices fitting their uploads
        to their link (``[edge] upload = "fit"``) aim for it."""
        if not self.durations:
            return 0.0
        typical = statistics.median(self.durations)
        if self.fs.mode == "async":
            return opened_at + typical * (self.fs.max_staleness + 1)
        return min(deadline, opened_at + typical)

    def _publish_model(self, round_: int) -> None:
        assert self.model is not None
        self._chunks, nbytes = self.publisher.model(self.model, round_)
        nbytes += self.deltas.publish(self.publisher, self.model, round_)  # thin links: the delta beside it
        if self.open is not None:
            self.open.stats.bytes_out += nbytes
            self.open.stats.model_bytes = self.model.size

    def _publish_plan(self, phase: str = "train") -> None:
        nbytes = self.publisher.plan(self._plan(phase))
        if self.open is not None:
            self.open.stats.bytes_out += nbytes

    def _republish(self) -> None:
        """After a reconnect: the broker may have restarted without the retained model and plan (Mosquitto
        saves them every ``autosave_interval``), and devices that missed them would wait forever."""
        if (self.open is None or self.open.timer is None) and self.calibration is None:
            return
        self.publisher.forget()
        self._publish_model(self.open.number if self.open is not None else 0)
        self._publish_plan("train" if self.open is not None else "calibrate")
        log.info("published the model and plan again after the reconnect")

    def _open_calibration(self, online: list[str]) -> None:
        self.calibration = Calibration(frozenset(online), self.clock() + self.fs.calibration_s)
        self._publish_model(0)
        self.publisher.plan(self._plan("calibrate"))
        log.info("calibration (round 0) open: %d devices %s", len(online), online)
        if self.on_progress is not None:
            self.on_progress("calibrate", {"selected": len(online)})

    def _resolve_calibration(self) -> None:
        cal, self.calibration = self.calibration, None
        assert cal is not None and self.model is not None
        try:
            self.strategy, resolved = cal.resolve(self.strategy)
        except CalibrationError as exc:
            raise CoordinatorError(str(exc)) from None
        bad = {k: v for k, v in resolved.items() if not isinstance(v, (str, int, float, bool))}
        if bad:
            raise CoordinatorError(f"the calibration resolved options the round plan cannot carry: {bad}")
        self.options = {**self.options, **resolved}
        self._calibrated = True
        save_checkpoint(self.cfg.state_dir, Checkpoint(0, self.global_state, self.model.digest, self.identity(),
                                                       dict(self.counters), dict(self.options), self.norms.norms))
        log.info("calibration resolved %s from %d report(s)", resolved, len(cal.reports))
        if self.on_progress is not None:
            self.on_progress("calibrated", {"resolved": resolved, "reports": len(cal.reports)})

    def _finish(self) -> None:
        """Publish the final model and a ``final`` plan (retained), save the global model, end."""
        assert self.model is not None
        self._publish_model(self.cfg.run.rounds + 1)
        self.publisher.plan(self._plan("final"))
        self.publisher.clear_old_models()
        meta = {"strategy": self.strategy.name, "rounds": self.cfg.run.rounds, "seed": self.cfg.run.seed,
                "role": "global", "digest": self.model.digest}
        save_model(self.cfg.state_dir / "global.safetensors", self.global_state, self.cfg.spec, meta)
        self._done = True
        log.info("federation finished after round %d; final model %s", self.done_round, self.model.digest[:12])
