"""The coordinator: one worker thread owns every piece of state; paho's callbacks only enqueue.

Per round (docs/explanation/design.md, "One round's data flow"): wait for ``min_devices`` online -> select among
them with over-selection -> journal the plan -> publish the global model as retained chunks and the
retained plan -> take update chunks as they come (:class:`protocol.ChunkCollector` under a memory
budget) -> for each complete update: screen and validate (:mod:`coordinator.intake`), journal and
fsync, fold into the strategy's streaming aggregator, ack -> close at quorum + grace, or at the
deadline (:mod:`coordinator.rounds`) -> checkpoint atomically, metrics line, next round. After the
last round the final model and a ``final`` plan are published (retained), so devices save their
personal models, and the run ends.

Restart: the checkpoint gives the last closed round r; the journal of round r+1, if any, gives its
plan (same selection) and every update already accepted, folded again; devices that re-send one of
those, or of the last closed rounds (their journals), are acked ``duplicate``. After a reconnect the
round's model and plan are published again (a restarted broker may have lost them). Stop
(:meth:`Coordinator.stop`, e.g. on SIGINT/SIGTERM) ends the loop after the current event; everything
acknowledged is already on disk. An I/O error on the state folder (a full disk, a file that cannot be
written: journal, checkpoint, quarantine, metrics) stops the loop the same way, before anything is
acknowledged that is not on disk: :class:`StateWriteError` names the file and the error, and a restart
resumes once the cause is fixed.

Asynchronous rounds (``mode = "async"``): ``"auto"`` settings are resolved at the start, logged and
recorded in the ``run`` line (:func:`flayer.engine.versions.resolve_async`); slots and the pace of plan
changes follow :mod:`coordinator.async_rounds` (a refusal changes no slot; plan records are bounded
per version; the holders are restored after a restart).

Against a hostile device (docs/explanation/security-hostile-devices.md): a bounded, fair receive queue
(:mod:`coordinator.receive`), a norm bound per round and the quarantine of updates that would make
the aggregate non-finite (:mod:`coordinator.guard`), retained input ignored and cleared (the inbox).

Prometheus metrics (``metrics_port``): :mod:`coordinator.exporter`, fed on this worker thread from the
counters and the round records in ``metrics.jsonl``; its HTTP server only reads the registry.
The coordinator is a composition of parts, each owning its state and given what it needs in its constructor
(docs/explanation/design.md, "The coordinator's parts"); this module wires them and runs the round loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from flayer.files import FolderBusyError, FolderLock, OpenFolderError, private_dir
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy
from protocol import Topics, WireLimits
from protocol.metrics_schema import end_record, epsilon_value, run_record
from transport.credentials import Credentials, CredentialsError, mqtt_connect_settings
from transport.link import Connected, Disconnected, MqttLink, Received
from transport.wirecount import WireBytes, count_wire_bytes

from .async_rounds import AsyncVersions
from .calibration import CalibrationPhase
from .config import CoordinatorConfig
from .cycle import RoundCycle
from .deltas import DeltaChain
from .device_certs import DeviceCerts
from .device_keys import DeviceKeys
from .exporter import FleetMetrics
from .guard import NormHistory, Quarantine
from .inbox import Inbox
from .journal import JournalError
from .messages_in import MessageIntake
from .metrics import MetricsLog
from .metrics_endpoint import MetricsEndpoint
from .model_files import ModelFiles
from .open_round import OpenRound
from .privacy import federation_privacy
from .publish import ModelBlob, Publisher, StopRequested
from .publishing import Publishing
from .receive import ReceiveQueue
from .registry import DeviceRegistry
from .result import CoordinatorError, CoordinatorResult, StateWriteError
from .revocations import RevocationList
from .secure_phase import SecureContext, SecurePhase, secure_strategy
from .state import Progress

__all__ = ["Coordinator", "CoordinatorError", "CoordinatorResult", "StateWriteError"]

log = logging.getLogger(__name__)


class _Stop:
    pass


class Coordinator:
    """``run()`` blocks (in the caller's thread) until the last round closed or :meth:`stop`."""

    def __init__(self, cfg: CoordinatorConfig, creds: Credentials, *, clock: Callable[[], float] = time.time,
                 strategy: Strategy | None = None, limits: WireLimits | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        if creds.role != "coordinator":
            raise CoordinatorError(f"credentials of {creds.username!r} are a {creds.role}'s; use the coordinator's")
        # "auto" asynchronous settings resolved once, here (flayer.engine.versions.resolve_async)
        settings, self.derived = cfg.federation.resolve_async()
        cfg = dataclasses.replace(cfg, federation=cfg.federation.resolved())
        self.cfg, self.creds, self.clock = cfg, creds, clock
        self.fs = fs = cfg.federation
        strategy = strategy or make_strategy(cfg.run.strategy, cfg.spec, cfg.run.train, cfg.options)
        # [privacy] (coordinator.privacy): resolved for the population, the strategy made private
        self.privacy, strategy = federation_privacy(cfg, strategy, settings.buffer)
        secure = bool(cfg.run.privacy.secure_aggregation)  # coordinator.secure_phase: secure rounds
        if secure and self.privacy is None:  # secure rounds need data-independent positions too
            strategy = secure_strategy(strategy)
        # in force: the config's, plus what a calibration resolved (or private rounds set: public positions)
        public = {"positions": "public"} if (self.privacy or secure) and "positions" in strategy.options_dict() \
            else {}
        self.progress = Progress(strategy, {**cfg.options, **public})
        self.topics = Topics(creds.federation)
        self.limits = limits or WireLimits(max_blob_bytes=max(fs.max_update_bytes, 1 << 20))
        self.events = ReceiveQueue(fs.queue_bytes, fs.queue_sender_bytes)
        self.on_progress = on_progress
        self.revoked = RevocationList(cfg.revoked_file)  # the intake is told who it adds (MessageIntake.withdraw)
        self.registry = DeviceRegistry(fs.stale_after_s, self.revoked.refresh)  # a revoked device is never online
        try:  # everything published is signed with the coordinator's key; a device is believed on its own key only
            self.signer = creds.signer()
        except CredentialsError as exc:
            raise CoordinatorError(str(exc)) from None
        self.device_keys = DeviceKeys(creds.federation, cfg.keys_file, self.revoked.refresh)  # and their certificates:
        self.device_certs = DeviceCerts(creds.federation, cfg.keys_file.parent if cfg.keys_file else None)
        self.counters: Counter[str] = Counter()
        self.link = MqttLink(mqtt_connect_settings(creds), self._post, clean_session=False)
        self.wire = WireBytes()  # every byte of the connection, for the rounds' bytes up / down
        count_wire_bytes(self.link.client, self.wire.add)
        self.inbox = Inbox(self.link, self.topics, creds.username, self.limits, fs, self.counters, self.signer,
                           self.device_keys)
        self.secure_phase = SecurePhase(SecureContext(cfg, creds, clock, self.registry, self.device_keys, self.inbox,
                                                      self.link, self.topics, self.signer, self.limits,
                                                      self.counters, self.privacy, self.device_certs))
        publisher = Publisher(self.link, self.topics, creds.username, creds.max_payload, cfg.state_dir,
                              fs.publish_timeout_s, lambda: self._stopping,
                              ModelFiles(cfg.models_dir) if cfg.models_dir is not None else None, self.signer)
        deltas = DeltaChain(fs.delta_downloads, creds.federation, creds.username)  # thin links
        self.publishing = Publishing(cfg, publisher, deltas, self.progress, self.privacy, self.secure_phase, clock)
        self._stopping = self._connected_once = False
        self._fatal: str | None = None
        self.calibration = CalibrationPhase(fs.calibration_s)
        try:  # 0700 whatever the umask: the journal holds every device's update; one coordinator only (flayer.files)
            private_dir(cfg.state_dir, "state_dir")
            self.state_lock = FolderLock(cfg.state_dir, "the coordinator's state_dir")
        except (OpenFolderError, FolderBusyError) as exc:
            raise CoordinatorError(str(exc)) from None
        self.metrics = MetricsLog(cfg.state_dir / "metrics.jsonl")
        # Prometheus (coordinator.exporter): fed on this worker thread, served when metrics_port is set
        self.exporter = FleetMetrics(creds.federation, cfg.run.strategy, fs.mode, fs.deadline_s, fs.queue_bytes,
                                     fs.staleness_bound if fs.mode == "async" else None, cfg.run.privacy.mode)
        self.endpoint = MetricsEndpoint(self.exporter, fs, cfg.metrics_token_file, cfg.state_dir)
        self.asynchronous = fs.mode == "async"  # buffered asynchronous rounds (coordinator.async_rounds)
        self.versions = AsyncVersions(settings, fs, cfg.run.rounds, cfg.run.seed, self.registry, self.online) \
            if self.asynchronous else None
        self.cycle = RoundCycle(cfg, creds.federation, creds.username, self.progress, clock=clock, limits=self.limits,
                                topics=self.topics, signer=self.signer, inbox=self.inbox, publishing=self.publishing,
                                calibration=self.calibration, secure=self.secure_phase, versions=self.versions,
                                privacy=self.privacy, norms=NormHistory(fs.norm_auto, fs.norm_window, fs.norm_warmup),
                                quarantine=Quarantine(cfg.state_dir), registry=self.registry,
                                counters=self.counters, metrics=self.metrics, exporter=self.exporter, wire=self.wire,
                                resubscribe=self._resubscribe, on_round=on_round, on_progress=on_progress)
        self.intake = MessageIntake(self.inbox, self.revoked, self.registry, self.cycle, self.secure_phase,
                                    self.calibration, self.versions, self.counters, clock, self._close, on_progress)
        if self.asynchronous:
            log.info("asynchronous rounds: buffer %d, max_staleness %d, concurrency %d%s", settings.buffer,
                     settings.max_staleness, settings.concurrency,
                     "".join(f"; {k} auto: {v}" for k, v in self.derived.items()))

    # ---- what the parts hold, read by the callers (tests, the emulator) ---------------------------
    @property
    def open(self) -> OpenRound | None:
        """The round in progress."""
        return self.cycle.open

    @property
    def strategy(self) -> Strategy:
        """The strategy in force (a calibration may have resolved its options)."""
        return self.progress.strategy

    @property
    def options(self) -> dict[str, Any]:
        """The strategy options in force, as the plans carry them."""
        return self.progress.options

    @property
    def done_round(self) -> int:
        """The last closed round (0: none yet)."""
        return self.progress.done_round

    @property
    def global_state(self) -> dict[str, torch.Tensor]:
        """The global model's tensors after the last closed round."""
        return self.progress.global_state

    @property
    def model(self) -> ModelBlob | None:
        """The global model's blob and digest (None before the start-up)."""
        return self.progress.model

    @property
    def history(self) -> list[dict[str, Any]]:
        """The closed rounds' records, as written to metrics.jsonl."""
        return self.progress.history

    def _post(self, event: Any) -> None:
        """paho's callbacks: enqueue only (a message over the queue's bounds is dropped and counted)."""
        self.events.put(event)

    # ---- public -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the worker to stop after the current event (safe from any thread or signal handler)."""
        self._stopping = True
        self.events.put(_Stop())

    def start(self) -> threading.Thread:
        """Run in a background thread (tests, the emulator); ``join()`` it, or call :meth:`stop`."""
        self._thread_result: CoordinatorResult | BaseException | None = None

        def target() -> None:
            try:
                self._thread_result = self.run()
            except BaseException as exc:
                log.exception("coordinator failed")
                self._thread_result = exc

        t = threading.Thread(target=target, name="coordinator", daemon=True)
        t.start()
        return t

    def run(self) -> CoordinatorResult:
        """Raises :class:`StateWriteError` (a :class:`CoordinatorError`) when the state folder cannot be
        written: the loop stops at once, nothing unjournaled acknowledged (module docstring)."""
        try:
            self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
            self.cycle.restore()
            self.endpoint.start(self.done_round, self.clock())
            extra = {"asynchronous": {**dataclasses.asdict(self.versions.slots.settings), "auto": dict(self.derived)}} \
                if self.versions is not None else {}
            self.metrics.write(run_record("coordinator", self.clock(), self.cfg.run.strategy, self.cfg.run.rounds,
                                          None, federation=self.creds.federation, resumed_after=self.done_round,
                                          **extra))
        except (OSError, JournalError) as exc:
            raise StateWriteError.of(exc, self.cfg.state_dir) from exc
        self.link.start()
        try:
            while not self.cycle.finished and not self._stopping:
                self._handle(self._next_event())
                if self._fatal:
                    raise CoordinatorError(self._fatal)
                if not self._stopping and self._connected_once:
                    self._tick()
                self.exporter.sync(self)
        except StopRequested:
            pass
        except (OSError, JournalError) as exc:
            err = StateWriteError.of(exc, self.cfg.state_dir)
            log.error("%s", err)
            raise err from exc
        finally:
            self._shut_down()
        model = self.progress.current_model()
        done = self.cycle.finished
        return CoordinatorResult(self.done_round, self.global_state, model.digest, self.history,
                                 dict(self.counters), done, self._stopping and not done)

    # ---- events -------------------------------------------------------------------------------
    def _next_event(self) -> Any:
        self.inbox.count_dropped(self.events.take_dropped())
        now = self.clock()
        return self.events.get(timeout=min(1.0, max(0.0, self._wake_at(now) - now)))

    def _wake_at(self, now: float) -> float:
        """When the open round's state may change without an event: its timer; in a secure round's key,
        share and unmask stages the stage's end; in asynchronous rounds the version's deadline. (A round
        timer's quorum + grace has passed by the unmask stage, and in an asynchronous version once the
        quorum's updates are in: waking at it would spin the loop.)"""
        rnd = self.open
        if rnd is None or rnd.timer is None:
            return now + 1.0
        if (sec := rnd.secure) is not None and (sec.stage != 3 or sec.held_until is not None):  # held: its deadline
            return float(sec.held_until if sec.stage == 3 and sec.held_until is not None else sec.stage_end)
        if self.asynchronous:  # a version closes at its buffer or its deadline, never at quorum + grace
            a = rnd.timer.announced  # (the last version may wait for announced uploads: coordinator.async_rounds)
            return min(rnd.timer.deadline, a.wake) if a is not None and a.wake is not None and a.wake > now \
                else rnd.timer.deadline
        return rnd.timer.next_wakeup(now)

    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Received):
            self.intake.on_message(ev)
        elif isinstance(ev, Connected):
            if not ev.ok:
                self._fatal = f"the broker refused the coordinator's connection ({ev.reason})"
                return
            log.info("connected to the broker (session present: %s)", ev.session_present)
            self.link.subscribe([self.topics.all_updates(), self.topics.all_status(), self.topics.all_metrics(),
                                 *([self.topics.all_secagg()] if self.secure_phase.enabled else [])])
            if self._connected_once:
                self.publishing.republish(self.open, self.calibration.current)
            elif self.open is None and 0 < self.done_round < self.cfg.run.rounds:
                # resumed or extended (more rounds than were run): the plan retained from before may be the old
                # run's final plan, which a finished device would take as the end; empty it until round n+1 opens,
                # and only then count as connected: a device started once we are sees the empty plan, not the old
                if not self.link.wait_published([self.link.publish(self.topics.round(), b"", retain=True)], 10.0):
                    log.warning("the broker did not acknowledge clearing the previous final plan within 10 s")
            self._connected_once = True
        elif isinstance(ev, Disconnected):
            log.warning("disconnected from the broker (%s); paho reconnects", ev.reason)

    def _resubscribe(self) -> None:
        """After a round's close: the broker re-sends what is retained under update/ and metrics/ (cleared)."""
        if self._connected_once:
            self.link.subscribe([self.topics.all_updates(), self.topics.all_metrics()])

    # ---- the round loop ------------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        rnd = self.open
        if rnd is None:
            self._between_rounds(now)
            return
        if rnd.timer is None:  # replayed from the journal: open it again
            self.cycle.start()
            return
        if self.versions is not None:
            closing = self.versions.tick(rnd, now, self.cycle.replan)
            if closing is not None:
                self._close(closing)
            return
        if rnd.secure is not None:  # keys, shares, unmasking (coordinator.secure_phase); in the masked inputs'
            closing = self.secure_phase.tick(rnd, now)  # stage: ended at once when too few of them can still come
            if closing is not None:
                self._close(closing)
            if rnd.secure.stage != 3 or self.open is not rnd:
                return
        decision = rnd.timer.decide(len(rnd.accepted), now)
        if decision.action == "extend":
            log.warning("round %d: %s", rnd.number, decision.reason)
            rnd.timer.extend()
            self.publishing.publish_plan("train", rnd)
        elif decision.action == "close" and rnd.secure is not None:  # the masked inputs are in: unmask their sum
            closing = self.secure_phase.tick(rnd, now, decision.reason)
            if closing is not None:
                self._close(closing)
        elif decision.action == "close":
            self._close(decision.reason)

    def _between_rounds(self, now: float) -> None:
        """No round open: the calibration, the end, or the next round."""
        online = self.online(now)
        cal = self.calibration
        if cal.current is not None:
            if cal.current.complete(now):
                self.cycle.resolve_calibration()
        elif self.done_round >= self.cfg.run.rounds:
            self.cycle.finish()
        elif len(online) >= self.fs.min_devices and cal.needed(self.strategy):
            self.cycle.calibrate(online)
        elif len(online) >= self.fs.min_devices or (self.versions is not None and self.done_round > 0):
            r = self.done_round + 1
            selected = self.versions.first(online, r, now) if self.versions is not None \
                else self.cycle.cohort(online, r)
            if selected is None or self.cycle.over_budget(r, selected):  # the federation ended before the round
                return
            self.cycle.start(self.cycle.begin(r, selected))
        elif self.on_progress is not None:
            self.on_progress("waiting", {"online": len(online), "needed": self.fs.min_devices})

    def _close(self, reason: str) -> None:
        self.cycle.close(reason)
        if self.versions is not None:
            self._tick()  # the next version's buffer opens at once: updates keep arriving

    def online(self, now: float) -> list[str]:
        """The devices online now, revoked ones and those a secure round proved faulty left out."""
        revoked = self.revoked.refresh()
        return [c for c in self.registry.online(now) if c not in revoked and c not in self.secure_phase.excluded]

    def _shut_down(self) -> None:
        """Close the journal and the metrics file (an I/O error here is logged: the loop is ending)."""
        try:
            if self.open is not None and self.open.journal is not None:
                self.open.journal.close()
            last = self.history[-1]["acc"] if self.history else None
            dp = {} if self.privacy is None else {"epsilon": epsilon_value(self.privacy.epsilon()),
                                                  "delta": self.privacy.delta, "budget_stop": self.cycle.budget_stop}
            self.metrics.write(end_record("coordinator", self.clock(), self.done_round, self.cycle.finished, last,
                                          counters=dict(self.counters), **dp))
            self.metrics.close()
        except OSError as exc:
            log.error("closing the state files: %s", exc)
        finally:
            self.exporter.sync(self, force=True)  # the final values (one more scrape may follow)
            self.endpoint.close(self.cycle.finished)
            self.link.stop()
            self.state_lock.release()  # another coordinator may take the folder now
