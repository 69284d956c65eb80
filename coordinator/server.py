"""The coordinator: one worker thread owns every piece of state; paho's callbacks only enqueue.

Per round (DESIGN.md, "Data flow of one round"): wait for ``min_devices`` online -> select among
them with over-selection -> journal the plan -> publish the global model as retained chunks and the
retained plan -> take update chunks as they come (:class:`protocol.ChunkCollector` under a memory
budget) -> for each complete update: screen and validate (:mod:`coordinator.intake`), journal and
fsync, fold into the strategy's streaming aggregator, ack -> close at quorum + grace, or at the
deadline (:mod:`coordinator.rounds`) -> checkpoint atomically, metrics line, next round. After the
last round the final model and a ``final`` plan are published (retained), so devices save their
personal models, and the run ends.

Restart: the checkpoint gives the last closed round r; the journal of round r+1, if any, gives its
plan (same selection) and every update already accepted, folded again; devices that re-send one of
those are acked ``duplicate``. Stop (:meth:`Coordinator.stop`, e.g. on SIGINT/SIGTERM) ends the
loop after the current event; everything acknowledged is already on disk.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flayer.simulation import initial_global_state
from flayer.state import save_model
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy
from mqtt_broker.credentials import Credentials, mqtt_connect_settings
from mqtt_broker.link import Connected, Disconnected, MqttLink, Received
from protocol import (
    Ack, ChunkCollector, Kind, Plan, Status, Topics, TopicError, WireError, WireLimits, check_topic,
    decode_envelope, decode_message, encode_message,
)

from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .config import CoordinatorConfig
from .intake import IntakeContext, Verdict, screen, validate
from .journal import Journal, journal_path, prune_journals, read_journal
from .metrics import MetricsLog, RoundStats
from .publish import ModelBlob, Publisher, StopRequested, model_blob
from .registry import DeviceRegistry
from .rounds import RoundTimer, select_devices

__all__ = ["Coordinator", "CoordinatorError", "CoordinatorResult"]

log = logging.getLogger(__name__)
ZERO_DIGEST = "0" * 64


class CoordinatorError(RuntimeError):
    """The coordinator cannot run (refused by the broker, unusable state folder, ...)."""


class _Stop:
    pass


@dataclass
class CoordinatorResult:
    rounds_done: int
    global_state: dict[str, torch.Tensor]
    model_digest: str
    history: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    finished: bool = False  # every round ran
    stopped: bool = False  # stop() ended it early


class Coordinator:
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
        self.events: queue.Queue[Any] = queue.Queue()
        self.on_round, self.on_progress = on_round, on_progress
        self.registry = DeviceRegistry(self.fs.stale_after_s)
        self.counters: Counter[str] = Counter()
        self.collector = ChunkCollector(self.limits, self.fs.max_pending_bytes)
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=False)
        self.publisher = Publisher(self.link, self.topics, creds.username, creds.max_payload, cfg.state_dir,
                                   self.fs.publish_timeout_s, lambda: self._stopping)
        self.history: list[dict[str, Any]] = []
        self._stopping = self._done = self._connected_once = False
        self._fatal: str | None = None
        self.done_round = 0
        self.global_state: dict[str, torch.Tensor] = {}
        self.model: ModelBlob | None = None
        self.round: int | None = None  # the open round (intake accepts updates for it)
        self.selected: frozenset[str] = frozenset()
        self.accepted: set[str] = set()
        self.accepted_before: dict[int, set[str]] = {}
        self._answered: set[tuple[str, int, str]] = set()
        self._resumed_plan: Plan | None = None
        self._chunks = 0
        self.timer: RoundTimer | None = None
        self.stats: RoundStats | None = None
        self.journal: Journal | None = None
        self.aggregator: Any = None
        self.ctx: IntakeContext | None = None
        self.metrics = MetricsLog(cfg.state_dir / "metrics.jsonl")

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
            except BaseException as exc:  # noqa: BLE001 -- handed to whoever joins
                log.exception("coordinator failed")
                self._thread_result = exc

        t = threading.Thread(target=target, name="coordinator", daemon=True)
        t.start()
        return t

    def run(self) -> CoordinatorResult:
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self._restore()
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
            if self.journal is not None:
                self.journal.close()
            self.metrics.close()
            self.link.stop()
        assert self.model is not None
        return CoordinatorResult(self.done_round, self.global_state, self.model.digest, self.history,
                                 dict(self.counters), self._done, self._stopping and not self._done)

    # ---- start-up: checkpoint and journal -------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return {"federation": self.creds.federation, "strategy": self.cfg.run.strategy, "seed": self.cfg.run.seed,
                "options": dict(self.cfg.options), "train": self.cfg.train_plan,
                "model": dataclasses.asdict(self.cfg.spec)}

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.cfg.state_dir, self.identity())
        if ckpt is None:
            self.global_state = initial_global_state(self.strategy, self.cfg.run.seed)
        else:
            self.done_round, self.global_state = ckpt.round, ckpt.global_state
            self.counters.update(ckpt.counters)
            log.info("resuming after round %d from %s", ckpt.round, self.cfg.state_dir)
        self.model = model_blob(self.global_state)
        if ckpt is not None and ckpt.model_digest and ckpt.model_digest != self.model.digest:
            raise CoordinatorError(f"checkpoint in {self.cfg.state_dir} does not match its recorded digest")
        path = journal_path(self.cfg.state_dir / "journal", self.done_round + 1)
        if self.done_round >= self.cfg.run.rounds or not path.exists():
            return
        replay = read_journal(path)
        if replay.plan is None:
            return
        try:
            _, plan = decode_message(replay.plan, self.limits, Kind.PLAN)
        except WireError as exc:
            raise CoordinatorError(f"journal {path}: unreadable plan ({exc.reason})") from None
        assert isinstance(plan, Plan)
        if plan.model_digest != self.model.digest:
            log.warning("journal %s is for another model; starting round %d afresh", path, plan.round)
            return
        self._resumed_plan = plan
        self._begin_intake(plan.round, plan.selected)
        for rec in replay.updates:
            if rec.round != plan.round or rec.client in self.accepted:
                continue
            verdict = validate(rec.client, rec.data, self._ctx())
            if not verdict.accepted or verdict.update is None:
                log.error("journal %s: record of %s no longer validates (%s)", path, rec.client, verdict.reason)
                continue
            self._fold(rec.client, verdict.update)
        log.info("replayed %d journaled update(s) of round %d", len(self.accepted), plan.round)

    def _ctx(self) -> IntakeContext:
        assert self.ctx is not None
        return self.ctx

    def _begin_intake(self, round_: int, selected: tuple[str, ...]) -> None:
        assert self.model is not None
        self.round, self.selected, self.accepted = round_, frozenset(selected), set()
        self.aggregator = self.strategy.aggregator(self.global_state, self.fs.norm_bound)
        self.stats = RoundStats(round_, sorted(selected), self.clock())
        self.ctx = IntakeContext(self.creds.federation, round_, self.model.digest, self.aggregator.shapes,
                                 self.limits, self.fs.max_update_bytes, self.fs.norm_bound, self.fs.norm_policy,
                                 self.selected)

    # ---- events -------------------------------------------------------------------------------
    def _next_event(self) -> Any:
        now = self.clock()
        wake = self.timer.next_wakeup() if self.timer is not None else now + 1.0
        try:
            return self.events.get(timeout=min(1.0, max(0.0, wake - now)))
        except queue.Empty:
            return None

    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Received):
            self._on_message(ev)
        elif isinstance(ev, Connected):
            if not ev.ok:
                self._fatal = f"the broker refused the coordinator's connection ({ev.reason})"
                return
            log.info("connected to the broker (session present: %s)", ev.session_present)
            self.link.subscribe([self.topics.all_updates(), self.topics.all_status(), self.topics.all_metrics()])
            self._connected_once = True
        elif isinstance(ev, Disconnected):
            log.warning("disconnected from the broker (%s); paho reconnects", ev.reason)

    def _on_message(self, ev: Received) -> None:
        try:
            parsed = self.topics.parse(ev.topic)
        except TopicError as exc:
            self._count("bad_message", f"{ev.topic}: {exc}")
            return
        if parsed.kind == "update":
            self._on_update_chunk(parsed, ev.payload)
        elif parsed.kind == "status":
            if not ev.payload:
                return  # a cleared retained status
            try:
                env, msg = decode_message(ev.payload, self.limits, Kind.STATUS)
                check_topic(env, parsed)
            except WireError as exc:
                self._count("bad_message", f"status of {parsed.client}: {exc.reason}")
                return
            assert isinstance(msg, Status) and parsed.client is not None
            self.registry.observe(parsed.client, msg, self.clock(), ev.retain)

    def _count(self, counter: str, reason: str, round_: int | None = None) -> None:
        self.counters[counter] += 1
        if self.stats is not None and (round_ is None or round_ == self.stats.round):
            self.stats.rejected[counter] += 1
        log.warning("%s: %s", counter, reason)

    def _ack(self, client: str, round_: int, digest: str, status: str, reason: str = "") -> None:
        payload = encode_message(Ack(round_, client, digest, status, reason[:500]), self.topics.federation,
                                 self.creds.username)
        self.link.publish(self.topics.ack(client), payload)

    def _on_update_chunk(self, parsed: Any, payload: bytes) -> None:
        client = parsed.client
        try:
            env = decode_envelope(payload, self.limits)
            check_topic(env, parsed)
        except WireError as exc:
            self._count("bad_chunk", f"update chunk from {client}: {exc.reason}")
            return
        if self.stats is not None:
            self.stats.bytes_in += len(payload)
        verdict = screen(client, env.round, self.round, self.selected, self.accepted, self.accepted_before)
        if verdict is None and env.total_size > self.fs.max_update_bytes:
            verdict = Verdict("rejected", f"update of {env.total_size} bytes exceeds max_update_bytes "
                                          f"{self.fs.max_update_bytes}", "oversize")
        if verdict is not None:
            key = (client, env.round, env.digest)
            if env.index == 0 or key not in self._answered:  # once per (re-)sent blob
                self._answered.add(key)
                assert verdict.counter is not None
                self._count(verdict.counter, f"{client} round {env.round}: {verdict.reason}", env.round)
                self._ack(client, env.round, env.digest, verdict.status, verdict.reason)
            return
        try:
            blob = self.collector.add(env)
        except WireError as exc:
            self._count("bad_chunk", f"update chunk from {client}: {exc.reason}")
            return
        if blob is not None:
            self._on_update(client, env.round, env.digest, blob)

    def _on_update(self, client: str, round_: int, digest: str, blob: bytes) -> None:
        assert self.stats is not None and self.journal is not None and self.timer is not None
        self.stats.received += 1
        verdict = validate(client, blob, self._ctx())
        if not verdict.accepted or verdict.update is None:
            assert verdict.counter is not None
            self._count(verdict.counter, f"{client} round {round_}: {verdict.reason}", round_)
            self._ack(client, round_, digest, verdict.status, verdict.reason)
            return
        self.journal.append_update(client, round_, blob)  # fsynced before folding and acking
        self._fold(client, verdict.update, verdict.clipped)
        self._ack(client, round_, digest, "accepted", verdict.reason)
        self.timer.accepted(len(self.accepted), self.clock())
        if self.on_progress is not None:
            self.on_progress("accepted", {"round": round_, "client": client, "accepted": len(self.accepted),
                                          "selected": len(self.selected)})

    def _fold(self, client: str, update: Any, clipped: bool = False) -> None:
        assert self.stats is not None
        self.aggregator.fold(update)
        self.accepted.add(client)
        self.stats.accepted += 1
        self.stats.clipped += int(clipped)
        self.counters["clipped"] += int(clipped)
        self.stats.add_eval(update.info)

    # ---- rounds -------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        if self.timer is None:
            if self.done_round >= self.cfg.run.rounds:
                self._finish()
            elif self._resumed_plan is not None:
                self._open_round(self._resumed_plan.round, self._resumed_plan.selected, resumed=True)
            elif len(self.registry.online(now)) >= self.fs.min_devices:
                r = self.done_round + 1
                online = self.registry.online(now)
                self._begin_intake(r, tuple(select_devices(online, self.fs.quorum, self.fs.over_selection,
                                                           self.cfg.run.seed, r)))
                self._open_round(r, tuple(sorted(self.selected)), resumed=False)
            return
        decision = self.timer.decide(len(self.accepted), now)
        if decision.action == "extend":
            log.warning("round %d: %s", self.round, decision.reason)
            self.timer.extend()
            self._publish_plan()
        elif decision.action == "close":
            self._close_round(decision.reason)

    def _plan(self, phase: str = "train") -> Plan:
        assert self.model is not None and self.round is not None and self._chunks > 0
        deadline = self.timer.deadline if self.timer is not None else self.clock()
        return Plan(round=self.round, selected=tuple(sorted(self.selected)), deadline=deadline,
                    strategy=self.strategy.name, options=dict(self.cfg.options), model=_spec_dict(self.cfg.spec),
                    model_digest=self.model.digest, model_chunks=self._chunks,
                    model_size=self.model.size, value_codec=self.fs.value_codec, compress=self.fs.compress,
                    phase=phase, seed=self.cfg.run.seed, train=self.cfg.train_plan, rounds=self.cfg.run.rounds,
                    max_update_bytes=self.fs.max_update_bytes)

    def _publish_model(self, round_: int) -> None:
        assert self.model is not None
        self._chunks, nbytes = self.publisher.model(self.model, round_)
        if self.stats is not None:
            self.stats.bytes_out += nbytes
            self.stats.model_bytes = self.model.size

    def _publish_plan(self, phase: str = "train") -> Plan:
        plan = self._plan(phase)
        nbytes = self.publisher.plan(plan)
        if self.stats is not None:
            self.stats.bytes_out += nbytes
        return plan

    def _open_round(self, r: int, selected: tuple[str, ...], resumed: bool) -> None:
        now = self.clock()
        self._resumed_plan = None
        self.timer = RoundTimer(now, now + self.fs.deadline_s, len(selected), self.fs.quorum, self.fs.grace_s,
                                self.fs.min_updates, self.fs.extend_s)
        self.timer.accepted(len(self.accepted), now)
        self._publish_model(r)
        self.journal = Journal(self.cfg.state_dir / "journal", r)
        if not resumed:
            self.journal.append_plan(encode_message(self._plan(), self.topics.federation, self.creds.username))
        self._publish_plan()
        self.publisher.clear_old_models()
        log.info("round %d open: %d selected %s, deadline in %.0f s%s", r, len(selected), list(selected),
                 self.fs.deadline_s, f", {len(self.accepted)} replayed" if resumed else "")
        if self.on_progress is not None:
            self.on_progress("open", {"round": r, "selected": len(selected), "accepted": len(self.accepted)})

    def _close_round(self, reason: str) -> None:
        assert self.round is not None and self.stats is not None and self.journal is not None
        r = self.round
        self.global_state = self.aggregator.result()
        self.model = model_blob(self.global_state)
        self.journal.close()
        self.journal = None
        self.done_round = r
        self.accepted_before = {k: v for k, v in self.accepted_before.items() if k >= r - 2}
        self.accepted_before[r] = set(self.accepted)
        save_checkpoint(self.cfg.state_dir, Checkpoint(r, self.global_state, self.model.digest, self.identity(),
                                                       dict(self.counters), dict(self.cfg.options)))
        record = self.stats.as_dict(self.clock(), reason, self.counters)
        self.metrics.write(record)
        self.history.append(record)
        prune_journals(self.cfg.state_dir / "journal", r, self.fs.keep_journals)
        self.collector.discard(k for k in self.collector.keys() if k[3] <= r)
        self._answered = {k for k in self._answered if k[1] > r - 2}
        self.round, self.timer, self.stats, self.ctx, self.aggregator = None, None, None, None, None
        self.selected, self.accepted = frozenset(), set()
        log.info("round %d closed (%s): %d accepted", r, reason, record["accepted"])
        if self.on_round is not None:
            self.on_round(record)

    def _finish(self) -> None:
        """Publish the final model and a ``final`` plan (retained), save the global model, end."""
        assert self.model is not None
        final = self.cfg.run.rounds + 1
        self.round = final
        self._publish_model(final)
        self.publisher.plan(self._plan("final"))
        self.publisher.clear_old_models()
        meta = {"strategy": self.strategy.name, "rounds": self.cfg.run.rounds, "seed": self.cfg.run.seed,
                "role": "global", "digest": self.model.digest}
        save_model(self.cfg.state_dir / "global.safetensors", self.global_state, self.cfg.spec, meta)
        self.round = None
        self._done = True
        log.info("federation finished after round %d; final model %s", self.done_round, self.model.digest[:12])


def _spec_dict(spec: Any) -> dict[str, Any]:
    return dict(dataclasses.asdict(spec))
