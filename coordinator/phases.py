"""The coordinator's publishing side and its phases outside a training round: the start (the
checkpoint and the journal of an interrupted round), opening a round (its open aggregate, journal, model
and plan), the round plan, the model and plan publications (and their re-publication after a
reconnect), round 0 (calibration) and the end of the federation.
A mixin of :class:`coordinator.server.Coordinator`, which holds the state."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from flayer.engine import VersionWindow, expected_close, initial_global_state
from flayer.state import load_initial_model, save_model
from flayer.strategies import make_strategy
from protocol import Plan, encode_message
from protocol.metrics_schema import end_record, epsilon_value

from .calibration import Calibration, CalibrationError
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .exporter import MetricsServer, read_token
from .open_round import OpenRound, folded_in, journaled_round, journaled_selection
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
    signer: Any  # the coordinator's SigningKey
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
    privacy: Any  # coordinator.privacy.FederationPrivacy | None
    registry: Any  # coordinator.registry.Registry: the devices that reported
    budget_stop: str | None
    slots: Any  # coordinator.async_rounds.Slots
    asynchronous: bool
    journal_dir: Any
    done_round: int
    global_state: dict[str, Any]
    accepted_before: dict[int, set[str]]
    _resumed: bool
    _calibrated: bool
    _done: bool
    history: list[dict[str, Any]]
    metrics: Any
    state_lock: Any  # flayer.files.FolderLock
    link: Any
    clock: Any
    exporter: Any  # coordinator.exporter.FleetMetrics
    metrics_server: MetricsServer | None
    _stopping: bool

    secure_phase: Any  # coordinator.secure_phase.SecurePhase
    secure: bool
    wire: Any
    pacer: Any
    topics: Any

    # ---- start-up: checkpoint and journal -------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        ident = {"federation": self.creds.federation, "strategy": self.cfg.run.strategy, "seed": self.cfg.run.seed,
                 "options": dict(self.cfg.options), "train": self.cfg.train_plan,
                 "model": dataclasses.asdict(self.cfg.spec)}
        if self.privacy is not None:  # a private run resumes only as the same private run
            ident["privacy"] = dataclasses.asdict(self.privacy.settings)
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
            self.norms.add(ckpt.norms, ckpt.norm_clients)
            self.secure_phase.excluded.update(ckpt.excluded)  # proven faulty: still left out
            if self.privacy is not None:
                try:
                    self.privacy.restore(ckpt.privacy, ckpt.round)
                except ValueError as exc:
                    raise CheckpointError(f"checkpoint in {self.cfg.state_dir}: {exc}") from None
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
        holders = list((ckpt.window if ckpt is not None else {}).get("slots") or [])
        if found is not None and found[0].secure:  # keys and shares were in the devices' memory only: abandoned
            self.open = self._begin(found[0].round, found[0].selected)
            self.open.open_journal(self.journal_dir)
            self.secure_phase.close(self.open, self.open.secure.abandon_early(
                "the coordinator restarted during the round's protocol; a secure round is never resumed"))
            return
        if found is not None:
            plan, replay = found
            holders = list(plan.selected)  # the last plan's: the slots held when it stopped
            self.open = self._begin(plan.round, plan.selected)
            if self.window is not None:  # every device a plan of this version offered a slot
                self.window.offer(journaled_selection(replay, self.limits))
            self._resumed = True
            log.info("replayed %d journaled update(s) of round %d", self.open.replay(replay, self.quarantine),
                     plan.round)
            self.open.open_journal(self.journal_dir)  # cuts a torn tail; re-sent updates may arrive at once
        if self.asynchronous and holders:  # coordinator.async_rounds, rule 4 (none whose update is in the buffer)
            in_buffer = self.window.buffered if found is not None else set()
            self.slots.restore((str(c) for c in holders if str(c) not in in_buffer), self.clock())
            log.info("slots restored after the restart: %s", sorted(self.slots.held))

    # ---- opening a round ------------------------------------------------------------------------
    def _begin(self, number: int, selected: tuple[str, ...] | list[str]) -> OpenRound:
        assert self.model is not None
        bound = self.norms.bound(self.fs.norm_bound, self.global_state)
        if self.secure_phase.enabled:  # masked inputs have no norm to bound here: the devices clip before masking
            log.info("round %d: secure round: the devices clip their updates to the bound before masking; only the "
                     "sum is checked (docs/explanation/secure-aggregation.md)", number)
        else:
            log.info("round %d: update norm bound %s", number, "none" if bound is None else f"{bound:.4g}")
        bases = None
        if self.window is not None:  # the buffer of version `number`: updates from recent versions are taken
            self.window.publish(number, self.model.digest)
            self.window.offer(selected)
            bases = dict(self.window.digests)
        if self.privacy is not None:  # the participation schema's history (coordinator.privacy, rule 3a)
            self.privacy.selected(number, selected)
        rnd = OpenRound.begin(number, selected, self.strategy, self.global_state, self.model.digest, self.fs,
                              self.creds.federation, self.limits, self.clock(), bound, bases,
                              self.privacy.round(len(selected)) if self.privacy else None)
        if self.window is not None:
            rnd.on_fold = self.window.fold
            rnd.stats.mode = "async"
        if self.secure_phase.enabled:  # coordinator.secure_phase: the round's protocol, a fresh session
            self.secure_phase.open(rnd)
        return rnd

    def _open_round(self) -> None:
        rnd = self.open
        assert rnd is not None
        now = self.clock()
        rnd.stats.wire_from = self.wire.snapshot()
        rnd.start_timer(self.fs, now)
        self._publish_model(rnd.number)
        if rnd.journal is None:
            rnd.open_journal(self.journal_dir)
        assert rnd.journal is not None
        if not self._resumed:  # the plan is journaled before it goes out: a restart selects the same devices
            rnd.journal.append_plan(encode_message(self._plan(), self.topics.federation, self.creds.username,
                                                     key=self.signer))
        self._resumed = False
        self._publish_plan()
        self.pacer.opened(rnd.number, now)
        self.publisher.clear_old_models()
        log.info("round %d open: %d selected %s, deadline in %.0f s, %d already accepted", rnd.number,
                 len(rnd.selected), sorted(rnd.selected), self.fs.deadline_s, len(rnd.accepted))
        if self.on_progress is not None:
            self.on_progress("open", {"round": rnd.number, "selected": len(rnd.selected),
                                      "accepted": len(rnd.accepted)})

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
        private = rnd.aggregate.privacy if rnd is not None else None
        plan = dataclasses.replace(plan, delta=self.deltas.plan_field(self.model.digest),  # thin links
                                   delta_chain=self.deltas.chain_field(self.model.digest), close_by=close_by,
                                   privacy=self._plan_privacy(private),
                                   secure=self.secure_phase.plan(rnd))
        self.secure_phase.bind(rnd, plan)  # the secure round's transcript covers the plan the devices read
        return plan

    def _plan_privacy(self, private: Any) -> dict[str, Any]:
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

    def _close_by(self, opened_at: float, deadline: float) -> float:
        """The plan's ``close_by``: :func:`flayer.engine.versions.expected_close` (0: no history yet)."""
        last = self.open is not None and self.open.number >= self.cfg.run.rounds
        close = expected_close(self.fs.mode, opened_at, deadline, self.durations, self.fs.max_staleness, last)
        return 0.0 if close is None else close

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

    def _serve_metrics(self) -> None:
        """Start the Prometheus endpoint when ``metrics_port`` is set (CoordinatorError when it cannot)."""
        self.exporter.restored(self.done_round, self.clock())
        fs = self.fs
        if fs.metrics_port is None:
            return
        try:
            token = read_token(self.cfg.metrics_token_file, fs.metrics_host, self.cfg.state_dir)
            self.metrics_server = MetricsServer(self.exporter.registry, fs.metrics_host, fs.metrics_port, token)
        except ValueError as exc:
            raise CoordinatorError(str(exc)) from None
        except OSError as exc:
            raise CoordinatorError(f"metrics: cannot listen on {fs.metrics_host}:{fs.metrics_port}: "
                                   f"{exc.strerror or exc}") from None
        self.metrics_server.serve_in_thread()
        log.info("Prometheus metrics at %s%s", self.metrics_server.url,
                 " (token required: Authorization: Bearer)" if self.metrics_server.token else "")

    def _close_metrics(self) -> None:
        """The final values; after the last round, up to ``metrics_linger_s`` for one more scrape of them."""
        self.exporter.sync(self, force=True)
        server, self.metrics_server = self.metrics_server, None
        if server is None:
            return
        if self._done and self.fs.metrics_linger_s > 0 and \
                not server.wait_scrape(server.scrapes, self.fs.metrics_linger_s):
            log.info("metrics: no scrape of the final values within %.0f s", self.fs.metrics_linger_s)
        server.close()

    def _shut_down(self) -> None:
        """Close the journal and the metrics file (an I/O error here is logged: the loop is ending)."""
        try:
            if self.open is not None and self.open.journal is not None:
                self.open.journal.close()
            last = self.history[-1]["acc"] if self.history else None
            dp = {} if self.privacy is None else {"epsilon": epsilon_value(self.privacy.epsilon()),
                                                  "delta": self.privacy.delta, "budget_stop": self.budget_stop}
            self.metrics.write(end_record("coordinator", self.clock(), self.done_round, self._done, last,
                                          counters=dict(self.counters), **dp))
            self.metrics.close()
        except OSError as exc:
            log.error("closing the state files: %s", exc)
        finally:
            self._close_metrics()
            self.link.stop()
            self.state_lock.release()  # another coordinator may take the folder now

    def _open_calibration(self, online: list[str]) -> None:
        self.calibration = Calibration(frozenset(online), self.clock() + self.fs.calibration_s, self.strategy)
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
                                                       dict(self.counters), dict(self.options), self.norms.norms,
                                                       {}, self.norms.clients))
        log.info("calibration resolved %s from %d report(s)", resolved, len(cal.reports))
        if self.on_progress is not None:
            self.on_progress("calibrated", {"resolved": resolved, "reports": len(cal.reports)})

    def _schema_stop(self, eligible: int, number: int) -> bool:
        """Too few online devices the participation schema allows for round ``number`` (coordinator.privacy,
        rule 3a): the federation ends."""
        why = None if self.privacy is None else self.privacy.schema_stop(eligible, self.fs.quorum, number)
        if why is None:
            return False
        log.warning("%s", why)
        self.budget_stop = why
        self._finish()
        return True

    def _over_budget(self, number: int, selected: Any) -> bool:
        """Round ``number`` would exceed ``target_epsilon``, or delta 1/N for the devices that reported
        (coordinator.privacy, rule 2): the federation ends."""
        why = None if self.privacy is None else \
            self.privacy.population_problem(len(self.registry)) or self.privacy.over_budget(number, len(selected))
        if why is None:
            return False
        log.warning("%s", why)
        self.budget_stop = why
        self._finish()
        return True

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
