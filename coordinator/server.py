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
acknowledged is already on disk.

Against a hostile device (docs/explanation/security-hostile-devices.md): a bounded, fair receive queue
(:mod:`coordinator.receive`), a norm bound per round and the quarantine of updates that would make
the aggregate non-finite (:mod:`coordinator.guard`), retained input ignored and cleared (the inbox).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from flayer.engine import VersionWindow
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy
from protocol import Kind, Metrics, Status, Topics, WireLimits, encode_message
from protocol.metrics_schema import end_record, run_record
from transport.credentials import Credentials, mqtt_connect_settings
from transport.link import Connected, Disconnected, MqttLink, Received
from transport.wirecount import WireBytes, count_wire_bytes

from .async_rounds import Slots
from .calibration import Calibration
from .checkpoint import Checkpoint, save_checkpoint
from .config import CoordinatorConfig
from .deltas import DeltaChain
from .guard import NormHistory, Quarantine
from .inbox import CompleteUpdate, Inbox
from .journal import prune_journals
from .metrics import MetricsLog
from .open_round import OpenRound
from .phases import Phases
from .publish import ModelBlob, Publisher, StopRequested
from .receive import ReceiveQueue
from .registry import DeviceRegistry
from .result import CoordinatorError, CoordinatorResult
from .revocations import RevocationList
from .rounds import select_devices

__all__ = ["Coordinator", "CoordinatorError", "CoordinatorResult"]

log = logging.getLogger(__name__)


class _Stop:
    pass


class Coordinator(Phases):
    """``run()`` blocks (in the caller's thread) until the last round closed or :meth:`stop`."""

    def __init__(self, cfg: CoordinatorConfig, creds: Credentials, *, clock: Callable[[], float] = time.time,
                 strategy: Strategy | None = None, limits: WireLimits | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        if creds.role != "coordinator":
            raise CoordinatorError(f"credentials of {creds.username!r} are a {creds.role}'s; use the coordinator's")
        self.cfg, self.creds, self.clock = cfg, creds, clock
        self.fs = cfg.federation
        self.strategy = strategy or make_strategy(cfg.run.strategy, cfg.spec, cfg.run.train, cfg.options)
        self.topics = Topics(creds.federation)
        self.limits = limits or WireLimits(max_blob_bytes=max(cfg.federation.max_update_bytes, 1 << 20))
        self.events = ReceiveQueue(self.fs.queue_bytes, self.fs.queue_sender_bytes)
        self.on_round, self.on_progress = on_round, on_progress
        self.registry = DeviceRegistry(self.fs.stale_after_s)
        self.revoked = RevocationList(cfg.revoked_file)
        self.counters: Counter[str] = Counter()
        self.link = MqttLink(mqtt_connect_settings(creds), self._post, clean_session=False)
        self.wire = WireBytes()  # every byte of the connection, for the rounds' bytes up / down
        count_wire_bytes(self.link.client, self.wire.add)
        self.inbox = Inbox(self.link, self.topics, creds.username, self.limits, self.fs, self.counters)
        self.publisher = Publisher(self.link, self.topics, creds.username, creds.max_payload, cfg.state_dir,
                                   self.fs.publish_timeout_s, lambda: self._stopping)
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
        self.options: dict[str, Any] = dict(cfg.options)  # in force: the config's, plus what a calibration resolved
        self.calibration: Calibration | None = None
        self._calibrated = False
        self.journal_dir = cfg.state_dir / "journal"
        self.metrics = MetricsLog(cfg.state_dir / "metrics.jsonl")
        self.norms = NormHistory(self.fs.norm_auto, self.fs.norm_window, self.fs.norm_warmup)
        self.quarantine = Quarantine(cfg.state_dir)
        self.asynchronous = self.fs.mode == "async"  # buffered asynchronous rounds (coordinator.async_rounds)
        self.window: VersionWindow | None = VersionWindow(self.fs.max_staleness) if self.asynchronous else None
        self.slots = Slots(self.fs.async_settings, cfg.run.seed, self.fs.deadline_s)
        self.durations: list[float] = []  # the last rounds' lengths: the plan's close_by (coordinator.phases)
        if self.asynchronous:
            self.inbox.on_refuse = self.slots.release

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
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self._restore()
        self.metrics.write(run_record("coordinator", self.clock(), self.cfg.run.strategy, self.cfg.run.rounds, None,
                                      federation=self.creds.federation, resumed_after=self.done_round))
        self.link.start()
        try:
            while not self._done and not self._stopping:
                self._handle(self._next_event())
                if self._fatal:
                    raise CoordinatorError(self._fatal)
                if not self._stopping and self._connected_once:
                    self._tick()
        except StopRequested:
            pass
        finally:
            if self.open is not None and self.open.journal is not None:
                self.open.journal.close()
            last = self.history[-1]["acc"] if self.history else None
            self.metrics.write(end_record("coordinator", self.clock(), self.done_round, self._done, last,
                                          counters=dict(self.counters)))
            self.metrics.close()
            self.link.stop()
        assert self.model is not None
        return CoordinatorResult(self.done_round, self.global_state, self.model.digest, self.history,
                                 dict(self.counters), self._done, self._stopping and not self._done)

    def _begin(self, number: int, selected: tuple[str, ...] | list[str]) -> OpenRound:
        assert self.model is not None
        bound = self.norms.bound(self.fs.norm_bound, self.global_state)
        log.info("round %d: update norm bound %s", number, "none" if bound is None else f"{bound:.4g}")
        bases = None
        if self.window is not None:  # the buffer of version `number`: updates from recent versions are taken
            self.window.publish(number, self.model.digest)
            self.window.offer(selected)
            bases = dict(self.window.digests)
        rnd = OpenRound.begin(number, selected, self.strategy, self.global_state, self.model.digest, self.fs,
                              self.creds.federation, self.limits, self.clock(), bound, bases)
        if self.window is not None:
            rnd.on_fold = self.window.fold
            rnd.stats.mode = "async"
        return rnd

    # ---- events -------------------------------------------------------------------------------
    def _next_event(self) -> Any:
        self.inbox.count_dropped(self.events.take_dropped())
        now = self.clock()
        timer = self.open.timer if self.open is not None else None
        wake = timer.next_wakeup() if timer is not None else now + 1.0
        return self.events.get(timeout=min(1.0, max(0.0, wake - now)))

    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Received):
            self._on_message(ev)
        elif isinstance(ev, Connected):
            if not ev.ok:
                self._fatal = f"the broker refused the coordinator's connection ({ev.reason})"
                return
            log.info("connected to the broker (session present: %s)", ev.session_present)
            self.link.subscribe([self.topics.all_updates(), self.topics.all_status(), self.topics.all_metrics()])
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

    def _on_message(self, ev: Received) -> None:
        parsed = self.inbox.parse(ev.topic)
        if parsed is None:
            return
        if self.inbox.not_input(parsed, ev):  # retained junk (cleared), or the echo of a clear
            return
        if parsed.client in self.revoked.refresh():
            self.inbox.count("revoked", f"{parsed.kind} from revoked device {parsed.client} dropped", parsed.client)
            return
        if parsed.kind == "update":
            try:
                done = self.inbox.update_chunk(parsed, ev.payload, self.done_round, self.accepted_before, self.window)
            except ValueError as exc:  # a check this code does not foresee: refuse, count, keep running
                log.exception("update chunk from %s", parsed.client)
                self.inbox.count("malformed", f"update chunk from {parsed.client}: {exc}")
                return
            if done is not None:
                self._accept(done)
        elif (got := self.inbox.message(parsed, ev.payload, Kind.STATUS if parsed.kind == "status"
                                        else Kind.METRICS)) is not None:
            env, msg = got
            assert parsed.client is not None
            if isinstance(msg, Status):
                self.registry.observe(parsed.client, msg, self.clock(), ev.retain)
            elif isinstance(msg, Metrics) and self.calibration is not None and msg.round == 0:
                status, reason = self.calibration.add(parsed.client, msg.values)
                if status != "accepted":
                    self.inbox.count(status if status in ("duplicate", "not_selected") else "bad_message", reason)
                self.inbox.ack(parsed.client, 0, env.digest, status, reason)

    def _accept(self, up: CompleteUpdate) -> None:
        rnd = self.open
        assert rnd is not None
        rnd.accept(up.client, up.round, up.blob, up.verdict, self.clock())  # journaled and fsynced, then folded
        if up.verdict.clipped:
            self.counters["clipped"] += 1
        if self.asynchronous:
            self.slots.release(up.client)  # the next tick gives the slot to an idle device
        self.inbox.ack(up.client, up.round, up.digest, "accepted", up.verdict.reason)
        if self.on_progress is not None:
            self.on_progress("accepted", {"round": up.round, "client": up.client, "accepted": len(rnd.accepted),
                                          "selected": len(rnd.selected)})

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
                    self.slots.drop_offline(online)
                    self.slots.fill(online, (), r, now)
                    selected = sorted(self.slots.held)
                else:
                    selected = select_devices(online, self.fs.quorum, self.fs.over_selection, self.cfg.run.seed, r)
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
        decision = rnd.timer.decide(len(rnd.accepted), now)
        if decision.action == "extend":
            log.warning("round %d: %s", rnd.number, decision.reason)
            rnd.timer.extend()
            self._publish_plan()
        elif decision.action == "close":
            self._close_round(decision.reason)

    def _online(self, now: float) -> list[str]:
        """The devices online now, revoked ones left out."""
        revoked = self.revoked.refresh()
        return [c for c in self.registry.online(now) if c not in revoked]

    def _tick_async(self, rnd: OpenRound, now: float) -> None:
        """The buffer of version ``rnd.number``: keep the slots filled, publish at ``buffer`` updates."""
        assert self.window is not None and rnd.timer is not None and rnd.journal is not None
        online = self._online(now)
        freed = self.slots.expire(now) + self.slots.drop_offline(online)
        new = self.slots.fill(online, self.window.folded.get(rnd.number, set()), rnd.number, now)
        if new or freed:
            self.window.offer(new)
            rnd.selected = frozenset(self.slots.held)
            rnd.stats.selected = sorted(set(rnd.stats.selected) | set(new))
            rnd.journal.append_plan(encode_message(self._plan(), self.topics.federation, self.creds.username))
            self._publish_plan()
        accepted = rnd.aggregate.tally.accepted
        if accepted >= self.fs.buffer:
            self._close_round(f"buffer of {self.fs.buffer} update(s) full")
        elif now >= rnd.timer.deadline:
            if accepted >= self.fs.min_updates:
                self._close_round(f"deadline with {accepted} of {self.fs.buffer} update(s)")
            else:
                rnd.timer.deadline = now + self.fs.deadline_s  # nothing to publish yet: keep buffering

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
            rnd.journal.append_plan(encode_message(self._plan(), self.topics.federation, self.creds.username))
        self._resumed = False
        self._publish_plan()
        self.publisher.clear_old_models()
        log.info("round %d open: %d selected %s, deadline in %.0f s, %d already accepted", rnd.number,
                 len(rnd.selected), sorted(rnd.selected), self.fs.deadline_s, len(rnd.accepted))
        if self.on_progress is not None:
            self.on_progress("open", {"round": rnd.number, "selected": len(rnd.selected),
                                      "accepted": len(rnd.accepted)})

    def _close_round(self, reason: str) -> None:
        rnd = self.open
        assert rnd is not None
        r = rnd.number
        old_state, old_model = self.global_state, self.model
        self.global_state, left_out = rnd.close(self.quarantine)
        if left_out:
            self.counters["quarantined"] += len(left_out)
        self.norms.add(rnd.norms)
        # thin links: the delta from the previous model (lossy: the new model is its reconstruction)
        self.global_state, self.model = self.deltas.advance(old_model, old_state, self.global_state, r + 1)
        self.done_round = r
        self.accepted_before = {k: v for k, v in self.accepted_before.items() if k >= r - 2}
        self.accepted_before[r] = set(rnd.accepted)
        # unfinished blobs are counted in this round's metrics (async: those still young enough stay)
        self.inbox.round_closed(r, r + 1 - self.fs.max_staleness if self.asynchronous else None)
        save_checkpoint(self.cfg.state_dir, Checkpoint(r, self.global_state, self.model.digest, self.identity(),
                                                       dict(self.counters), dict(self.options), self.norms.norms,
                                                       self.window.as_dict() if self.window is not None else {}))
        if self._connected_once:  # the broker re-sends what is retained under update/ and metrics/: cleared
            self.link.subscribe([self.topics.all_updates(), self.topics.all_metrics()])
        rnd.stats.wire_to = self.wire.snapshot()
        record = rnd.stats.as_dict(self.clock(), reason, self.counters, rnd.accepted)
        self.durations = [*self.durations[-4:], float(record["wall_s"])]
        self.metrics.write(record)
        self.history.append(record)
        prune_journals(self.journal_dir, r, self.fs.keep_journals)
        self.open = None
        log.info("round %d closed (%s): %d accepted", r, reason, record["accepted"])
        if self.on_round is not None:
            self.on_round(record)
        if self.asynchronous:
            self._tick()  # the next version's buffer opens at once: updates keep arriving
