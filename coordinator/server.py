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
counters and the round records written to ``metrics.jsonl``; its HTTP server only reads the registry.
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

from flayer.engine import VersionWindow
from flayer.files import FolderBusyError, FolderLock, OpenFolderError, private_dir
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy
from protocol import Topics, WireLimits
from protocol.metrics_schema import run_record
from transport.credentials import Credentials, CredentialsError, mqtt_connect_settings
from transport.link import Connected, Disconnected, MqttLink, Received
from transport.wirecount import WireBytes, count_wire_bytes

from .async_rounds import AsyncRounds, PlanPacer, Slots
from .calibration import Calibration
from .checkpoint import Checkpoint, save_checkpoint
from .config import CoordinatorConfig
from .deltas import DeltaChain
from .device_certs import DeviceCerts
from .device_keys import DeviceKeys
from .exporter import FleetMetrics, MetricsServer
from .guard import NormHistory, Quarantine
from .inbox import Inbox
from .journal import JournalError, prune_journals
from .messages_in import MessageIntake
from .metrics import MetricsLog
from .model_files import ModelFiles
from .open_round import OpenRound
from .phases import Phases
from .privacy import federation_privacy
from .publish import ModelBlob, Publisher, StopRequested
from .receive import ReceiveQueue
from .registry import DeviceRegistry
from .result import CoordinatorError, CoordinatorResult, StateWriteError
from .revocations import RevocationList
from .round_log import closing_notes
from .rounds import select_devices
from .secure_phase import SecurePhase, secure_strategy

__all__ = ["Coordinator", "CoordinatorError", "CoordinatorResult", "StateWriteError"]

log = logging.getLogger(__name__)


class _Stop:
    pass


class Coordinator(Phases, AsyncRounds, MessageIntake):
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
        self.fs = cfg.federation
        self.strategy = strategy or make_strategy(cfg.run.strategy, cfg.spec, cfg.run.train, cfg.options)
        # [privacy] (coordinator.privacy): resolved for the population, the strategy made private
        self.privacy, self.strategy = federation_privacy(cfg, self.strategy, settings.buffer)
        self.secure_phase = SecurePhase(self)  # coordinator.secure_phase: secure rounds, when [privacy] asks
        if self.secure_phase.enabled and self.privacy is None:  # secure rounds need data-independent positions too
            self.strategy = secure_strategy(self.strategy)
        self.budget_stop: str | None = None
        self.topics = Topics(creds.federation)
        self.limits = limits or WireLimits(max_blob_bytes=max(cfg.federation.max_update_bytes, 1 << 20))
        self.events = ReceiveQueue(self.fs.queue_bytes, self.fs.queue_sender_bytes)
        self.on_round, self.on_progress = on_round, on_progress
        self.registry = DeviceRegistry(self.fs.stale_after_s)
        self.revoked = RevocationList(cfg.revoked_file)
        try:  # everything published is signed with the coordinator's key; a device is believed on its own key only
            self.signer = creds.signer()
        except CredentialsError as exc:
            raise CoordinatorError(str(exc)) from None
        self.device_keys = DeviceKeys(creds.federation, cfg.keys_file, self.revoked.refresh)
        self.device_certs = DeviceCerts(creds.federation, cfg.keys_file.parent if cfg.keys_file else None)
        self.counters: Counter[str] = Counter()
        self.link = MqttLink(mqtt_connect_settings(creds), self._post, clean_session=False)
        self.wire = WireBytes()  # every byte of the connection, for the rounds' bytes up / down
        count_wire_bytes(self.link.client, self.wire.add)
        self.inbox = Inbox(self.link, self.topics, creds.username, self.limits, self.fs, self.counters, self.signer,
                           self.device_keys)
        self.publisher = Publisher(self.link, self.topics, creds.username, creds.max_payload, cfg.state_dir,
                                   self.fs.publish_timeout_s, lambda: self._stopping,
                                   ModelFiles(cfg.models_dir) if cfg.models_dir is not None else None, self.signer)
        self.deltas = DeltaChain(self.fs.delta_downloads, creds.federation, creds.username)  # thin links
        self.history: list[dict[str, Any]] = []
        self._stopping = self._done = self._connected_once = False
        self._fatal: str | None = None
        self.done_round = 0
        self.global_state: dict[str, torch.Tensor] = {}
        self.model: ModelBlob | None = None
        self.accepted_before: dict[int, set[str]] = {}  # recent closed rounds (duplicates vs late)
        self._resumed = False
        self._chunks = 0
        # in force: the config's, plus what a calibration resolved (or private rounds set: public positions)
        public = {"positions": "public"} if (self.privacy or self.secure_phase.enabled) and "positions" in \
            self.strategy.options_dict() else {}
        self.options: dict[str, Any] = {**cfg.options, **public}
        self.calibration: Calibration | None = None
        self._calibrated = False
        self.journal_dir = cfg.state_dir / "journal"
        try:  # 0700 whatever the umask: the journal holds every device's update; one coordinator only (flayer.files)
            private_dir(cfg.state_dir, "state_dir")
            self.state_lock = FolderLock(cfg.state_dir, "the coordinator's state_dir")
        except (OpenFolderError, FolderBusyError) as exc:
            raise CoordinatorError(str(exc)) from None
        self.metrics = MetricsLog(cfg.state_dir / "metrics.jsonl")
        # Prometheus (coordinator.exporter): fed on this worker thread, served when metrics_port is set
        self.exporter = FleetMetrics(creds.federation, cfg.run.strategy, self.fs.mode, self.fs.deadline_s,
                                     self.fs.queue_bytes, self.fs.max_staleness if self.fs.mode == "async" else None)
        self.metrics_server: MetricsServer | None = None
        self.norms = NormHistory(self.fs.norm_auto, self.fs.norm_window, self.fs.norm_warmup)
        self.quarantine = Quarantine(cfg.state_dir)
        self.asynchronous = self.fs.mode == "async"  # buffered asynchronous rounds (coordinator.async_rounds)
        self.window: VersionWindow | None = VersionWindow(self.fs.max_staleness) if self.asynchronous else None
        self.slots = Slots(settings, cfg.run.seed, self.fs.deadline_s)  # a refusal frees no slot
        self.pacer = PlanPacer(self.fs.buffer)
        self.durations: list[float] = []  # the last rounds' lengths: the plan's close_by (coordinator.phases)
        if self.asynchronous:
            log.info("asynchronous rounds: buffer %d, max_staleness %d, concurrency %d%s", settings.buffer,
                     settings.max_staleness, settings.concurrency,
                     "".join(f"; {k} auto: {v}" for k, v in self.derived.items()))

    @property
    def open(self) -> OpenRound | None:
        """The round in progress (the inbox counts refusals into its metrics)."""
        return self.inbox.open

    @open.setter
    def open(self, rnd: OpenRound | None) -> None:
        self.inbox.open = rnd

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
            self._restore()
            self._serve_metrics()  # coordinator.phases
            extra = {"asynchronous": {**dataclasses.asdict(self.slots.settings), "auto": dict(self.derived)}} \
                if self.asynchronous else {}
            self.metrics.write(run_record("coordinator", self.clock(), self.cfg.run.strategy, self.cfg.run.rounds,
                                          None, federation=self.creds.federation, resumed_after=self.done_round,
                                          **extra))
        except (OSError, JournalError) as exc:
            raise StateWriteError.of(exc, self.cfg.state_dir) from exc
        self.link.start()
        try:
            while not self._done and not self._stopping:
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
        assert self.model is not None
        return CoordinatorResult(self.done_round, self.global_state, self.model.digest, self.history,
                                 dict(self.counters), self._done, self._stopping and not self._done)

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
        if rnd.secure is not None and rnd.secure.stage != 3:
            return rnd.secure.stage_end
        if self.asynchronous:  # a version closes at its buffer or its deadline, never at quorum + grace
            a = rnd.timer.announced  # (the last version may wait for announced uploads: coordinator.async_rounds)
            return min(rnd.timer.deadline, a.wake) if a is not None and a.wake is not None and a.wake > now \
                else rnd.timer.deadline
        return rnd.timer.next_wakeup(now)

    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Received):
            self._on_message(ev)
        elif isinstance(ev, Connected):
            if not ev.ok:
                self._fatal = f"the broker refused the coordinator's connection ({ev.reason})"
                return
            log.info("connected to the broker (session present: %s)", ev.session_present)
            self.link.subscribe([self.topics.all_updates(), self.topics.all_status(), self.topics.all_metrics(),
                                 *([self.topics.all_secagg()] if self.secure_phase.enabled else [])])
            if self._connected_once:
                self._republish()
            elif self.open is None and 0 < self.done_round < self.cfg.run.rounds:
                # resumed or extended (more rounds than were run): the plan retained from before may be the old
                # run's final plan, which a finished device would take as the end; empty it until round n+1 opens,
                # and only then count as connected: a device started once we are sees the empty plan, not the old
                if not self.link.wait_published([self.link.publish(self.topics.round(), b"", retain=True)], 10.0):
                    log.warning("the broker did not acknowledge clearing the previous final plan within 10 s")
            self._connected_once = True
        elif isinstance(ev, Disconnected):
            log.warning("disconnected from the broker (%s); paho reconnects", ev.reason)

    # ---- rounds -------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        rnd = self.open
        if rnd is None:
            online = self._online(now)
            if self.calibration is not None:
                if self.calibration.complete(now):
                    self._resolve_calibration()
            elif self.done_round >= self.cfg.run.rounds:
                self._finish()
            elif len(online) >= self.fs.min_devices and not self._calibrated and self.strategy.needs_calibration():
                self._open_calibration(online)
            elif len(online) >= self.fs.min_devices or (self.asynchronous and self.done_round > 0):
                r = self.done_round + 1
                if self.asynchronous:
                    self.slots.drop_offline(online, self._heard_offline(online))
                    self.slots.fill(online, (), r, now)
                    selected = sorted(self.slots.held)
                else:
                    pool = self.privacy.eligible(online, r) if self.privacy is not None else online
                    if self.privacy is not None and self._schema_stop(len(pool), r):
                        return
                    selected = select_devices(pool, self.fs.quorum, self.fs.over_selection, self.cfg.run.seed, r)
                if self._over_budget(r, selected):  # target_epsilon: the federation ends before the budget
                    return
                self.open = self._begin(r, selected)
                self._open_round()
            elif self.on_progress is not None:
                self.on_progress("waiting", {"online": len(online), "needed": self.fs.min_devices})
            return
        if rnd.timer is None:  # replayed from the journal: open it again
            self._open_round()
            return
        if self.asynchronous:
            self._tick_async(rnd, now)
            return
        if rnd.secure is not None:  # keys, shares, unmasking (coordinator.secure_phase); in the masked inputs'
            self.secure_phase.tick(rnd, now)  # stage: ended at once when too few of them can still come
            if rnd.secure.stage != 3 or self.open is not rnd:
                return
        decision = rnd.timer.decide(len(rnd.accepted), now)
        if decision.action == "extend":
            log.warning("round %d: %s", rnd.number, decision.reason)
            rnd.timer.extend()
            self._publish_plan()
        elif decision.action == "close" and rnd.secure is not None:  # the masked inputs are in: unmask their sum
            self.secure_phase.tick(rnd, now, decision.reason)
        elif decision.action == "close":
            self._close_round(decision.reason)

    def _online(self, now: float) -> list[str]:
        """The devices online now, revoked ones and those a secure round proved faulty left out."""
        revoked = self.revoked.refresh()
        return [c for c in self.registry.online(now) if c not in revoked and c not in self.secure_phase.excluded]

    def _close_round(self, reason: str) -> None:
        rnd = self.open
        assert rnd is not None
        r = rnd.number
        old_state, old_model = self.global_state, self.model
        withheld = self.privacy.withheld(rnd.aggregate) if self.privacy is not None else None
        if withheld is not None:  # a local-mode round short of min_updates past the target: nothing published
            log.warning("round %d: %s", r, withheld)
            rnd.aggregate.withhold()
        self.global_state, left_out = rnd.close(self.quarantine)
        if self.privacy is not None and withheld is None:  # rule 5 of coordinator.privacy: post-processing
            self.global_state = self.privacy.step.apply(old_state, self.global_state)
        if left_out:
            self.counters["quarantined"] += len(left_out)
        self.norms.add(rnd.norms, rnd.norm_clients)
        # thin links: the delta from the previous model (lossy: the new model is its reconstruction)
        self.global_state, self.model = self.deltas.advance(old_model, old_state, self.global_state, r + 1)
        self.done_round = r
        self.accepted_before = {k: v for k, v in self.accepted_before.items() if k >= r - 2}
        self.accepted_before[r] = set(rnd.accepted)
        # unfinished blobs are counted in this round's metrics (async: those still young enough stay)
        self.inbox.round_closed(r, r + 1 - self.fs.max_staleness if self.asynchronous else None)
        dp = self.privacy.close(rnd.aggregate) if self.privacy is not None else {}  # composed, then checkpointed
        save_checkpoint(self.cfg.state_dir, Checkpoint(r, self.global_state, self.model.digest, self.identity(),
                                                       dict(self.counters), dict(self.options), self.norms.norms,
                                                       self._window_record(), self.norms.clients,
                                                       self.privacy.state() if self.privacy is not None else {},
                                                       dict(self.secure_phase.excluded)))
        if self._connected_once:  # the broker re-sends what is retained under update/ and metrics/: cleared
            self.link.subscribe([self.topics.all_updates(), self.topics.all_metrics()])
        rnd.stats.wire_to = self.wire.snapshot()
        record = {**rnd.stats.as_dict(self.clock(), reason, self.counters, rnd.accepted), **dp}
        # the plan's close_by aims for quorum + grace: a round that waited for announced uploads counts to there
        base = rnd.timer.quorum_at + rnd.timer.grace_s - rnd.timer.opened_at \
            if rnd.timer is not None and rnd.timer.quorum_at is not None and not self.asynchronous else float("inf")
        self.durations = [*self.durations[-4:], min(float(record["wall_s"]), base)]
        self.metrics.write(record)
        self.exporter.round_closed(record)  # the same record: the scrape and the file agree
        self.history.append(record)
        prune_journals(self.journal_dir, r, self.fs.keep_journals)
        self.open = None
        log.info("round %d closed (%s): %d accepted%s", r, reason, record["accepted"], closing_notes(record))
        if self.on_round is not None:
            self.on_round(record)
        if self.asynchronous:
            self._tick()  # the next version's buffer opens at once: updates keep arriving
