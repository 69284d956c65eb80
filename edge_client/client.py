"""The edge client: one device's MQTT session, download, local round, upload and state on disk.

Threads: paho's network thread only enqueues (:class:`mqtt_broker.link.MqttLink`); the client's
worker thread owns all state and reacts to events (plan, model chunk, ack, timers); one job thread
runs what takes long -- the local round, publishing and waiting for PUBACKs -- and reports back
with an event. Many clients can live in one process (the emulator): each has its own connection,
threads and state folder, an injectable ``clock``/``sleep`` and a link ``shaper(nbytes, direction)``
that returns the delay to impose on each chunk ("up" or "down").

Per round, when selected: subscribe to ``model/<digest>/+`` and reassemble the retained chunks
(kept across reconnects; the blob is checked against its digest and the plan's model) -> local
round -> encode and size check -> persist state and upload -> publish the chunks (QoS 1, PUBACKs)
-> wait for the coordinator's ack, re-sending with exponential backoff and jitter. A restarted
device reloads its state and re-sends an unacknowledged upload of the current round without
training again. After the ``final`` plan it saves its personal model and stops.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from flayer.state import save_model
from flayer.train import ClientData, evaluate, pick_device
from flayer.update import float_state
from mqtt_broker.credentials import Credentials, mqtt_connect_settings
from mqtt_broker.link import Connected, Disconnected, MqttLink, Received
from protocol import (
    Ack,
    Kind,
    Plan,
    Reassembler,
    Status,
    TopicError,
    Topics,
    WireError,
    WireLimits,
    chunk_blob,
    decode_envelope,
    decode_message,
    encode_message,
)

from .config import EdgeSettings
from .store import DeviceStore, StoredState, UploadRecord
from .work import (
    EdgeError,
    StrategyCache,
    Upload,
    check_data_fits,
    decode_global,
    round_context,
    train_and_encode,
)

__all__ = ["EdgeClient", "EdgeError", "LinkShaper"]

log = logging.getLogger(__name__)

LinkShaper = Callable[[int, str], float]  # (bytes, "up" | "down") -> seconds of delay


@dataclass(frozen=True)
class _Job:
    kind: str  # trained | published | finished
    round: int
    result: Any = None
    error: BaseException | None = None


class _Stop:
    pass


class EdgeClient:
    def __init__(self, settings: EdgeSettings, creds: Credentials, data: ClientData, *,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 shaper: LinkShaper | None = None, limits: WireLimits | None = None,
                 rng: random.Random | None = None,
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        if creds.role != "device":
            raise EdgeError(f"credentials of {creds.username!r} are a {creds.role}'s, not a device's")
        self.settings, self.creds, self.data = settings, creds, data
        self.id = creds.username
        self.clock, self.sleep, self.shaper = clock, sleep, shaper
        self.limits = limits or WireLimits()
        self.rng = rng or random.Random(f"{creds.federation}/{self.id}")
        self.on_progress = on_progress  # called on the worker thread: trained, ack, finished
        self.topics = Topics(creds.federation)
        self.device = pick_device(settings.device)
        self.store = DeviceStore(settings.state_dir)
        self.stored: StoredState = self.store.load()
        self.strategies = StrategyCache({"device": str(self.device), "threads": settings.threads,
                                         "amp": settings.amp})
        self.events: queue.Queue[Any] = queue.Queue()
        will = encode_message(Status(0, "offline", clock(), {}), creds.federation, self.id)
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=False,
                             will=(self.topics.status(self.id), will), keepalive=settings.keepalive_s)
        self.jobs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"edge-{self.id}-job")
        self.plan: Plan | None = None
        self.error: BaseException | None = None
        self.finished = self.stored.finished
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = False  # a job is running
        self._download: tuple[str, Reassembler] | None = None
        self._model: tuple[str, dict[str, torch.Tensor]] | None = None
        self._last_chunk_at = 0.0
        self._ack_due: float | None = None
        self._attempt = 0
        self._heartbeat_at = 0.0
        self._state_name = "online"
        self._pending_payloads: tuple[bytes, ...] | None = None
        self.rounds_trained: list[int] = []

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.link.start()
        self._thread = threading.Thread(target=self._loop, name=f"edge-{self.id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker, publish a retained ``offline`` status and disconnect cleanly."""
        self.events.put(_Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the client stopped (finished, stopped or failed)."""
        return self._stopped.wait(timeout)

    def run(self) -> None:
        """Start and block until the client stops; raises the error that stopped it, if any."""
        self.start()
        try:
            while not self.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.stop()
            raise
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        try:
            while True:
                ev = self._next_event()
                if isinstance(ev, _Stop):
                    break
                self._handle(ev)
                self._timers()
        except BaseException as exc:  # noqa: BLE001 -- reported through self.error / run()
            log.error("%s: %s", self.id, exc)
            self.error = exc
        finally:
            self.link.stop(final=(self.topics.status(self.id), self._status_payload("offline"), True))
            self.jobs.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()

    def _next_event(self) -> Any:
        now = self.clock()
        due = [self._heartbeat_at, self._ack_due or now + 1.0]
        if self._download is not None:
            due.append(self._last_chunk_at + self.settings.download_stall_s)
        try:
            return self.events.get(timeout=min(1.0, max(0.0, min(due) - now)))
        except queue.Empty:
            return None

    # ---- events -------------------------------------------------------------------------------
    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Received):
            self._on_message(ev)
        elif isinstance(ev, Connected):
            if not ev.ok:
                raise EdgeError(f"{self.id}: the broker refused the connection ({ev.reason}); check the "
                                f"credentials file")
            self.link.subscribe([self.topics.round(), self.topics.ack(self.id)])
            if self._download is not None:  # retained chunks are sent again on a new subscription
                self._resubscribe_model()
            self._heartbeat_at = 0.0
        elif isinstance(ev, Disconnected):
            log.warning("%s: disconnected (%s); paho reconnects", self.id, ev.reason)
        elif isinstance(ev, _Job):
            self._on_job(ev)

    def _on_message(self, ev: Received) -> None:
        if not ev.payload:
            return
        try:
            parsed = self.topics.parse(ev.topic)
            if parsed.kind == "model":
                self._on_model_chunk(parsed.digest or "", ev.payload)
            elif parsed.kind == "round":
                _, plan = decode_message(ev.payload, self.limits, Kind.PLAN)
                assert isinstance(plan, Plan)
                self._on_plan(plan)
            elif parsed.kind == "ack":
                _, ack = decode_message(ev.payload, self.limits, Kind.ACK)
                assert isinstance(ack, Ack)
                self._on_ack(ack)
        except (WireError, TopicError) as exc:
            log.warning("%s: ignoring a bad message on %s: %s", self.id, ev.topic, exc)

    def _on_plan(self, plan: Plan) -> None:
        self.plan = plan
        up = self.stored.upload
        if up is not None and not up.settled and up.round < plan.round and plan.phase != "final":
            log.warning("%s: upload of round %d was never acknowledged; round %d is open, dropping it",
                        self.id, up.round, plan.round)
            self._settle("dropped")
        if plan.phase == "final":
            if self.finished and self.settings.exit_when_finished:
                self.events.put(_Stop())
            elif not self.finished and not self._busy:
                self._fetch(plan)
            return
        if plan.phase != "train" or self._busy:
            return  # calibration is not implemented by this client yet; a busy job re-checks the plan
        if up is not None and up.round == plan.round and not up.settled:
            if self._ack_due is None:
                self._resend()
            return
        if self.id not in plan.selected or plan.round <= self.stored.done_round:
            self._set_state("idle")
            return
        self._fetch(plan)

    def _fetch(self, plan: Plan) -> None:
        if self._model is not None and self._model[0] == plan.model_digest:
            self._model_ready()
            return
        if self._download is None or self._download[0] != plan.model_digest:
            if self._download is not None:
                self.link.unsubscribe([self.topics.model_filter(self._download[0])])
            self._download = (plan.model_digest, Reassembler(self.limits))
            self._last_chunk_at = self.clock()
            self.link.subscribe([self.topics.model_filter(plan.model_digest)])
            self._set_state("online")

    def _resubscribe_model(self) -> None:
        assert self._download is not None
        f = self.topics.model_filter(self._download[0])
        self.link.unsubscribe([f])
        self.link.subscribe([f])
        self._last_chunk_at = self.clock()

    def _on_model_chunk(self, digest: str, payload: bytes) -> None:
        if self._download is None or digest != self._download[0]:
            return
        if self.shaper is not None:
            self.sleep(self.shaper(len(payload), "down"))
        self._last_chunk_at = self.clock()
        env = decode_envelope(payload, self.limits)
        if env.kind != Kind.MODEL_CHUNK or env.digest != digest:
            raise WireError("model chunk on the wrong topic")
        try:
            done = self._download[1].add(env)
        except WireError as exc:  # a copy published for another round: start over with this one
            log.info("%s: model chunk %d conflicts with those held (%s); restarting the download", self.id,
                     env.index, exc.reason)
            self._download = (digest, Reassembler(self.limits))
            done = self._download[1].add(env)
        if not done:
            return
        blob = self._download[1].blob()
        self.link.unsubscribe([self.topics.model_filter(digest)])
        self._download = None
        assert self.plan is not None
        strategy = self.strategies.get(self.plan)
        self._model = (digest, decode_global(blob, strategy, self.limits))
        self._model_ready()

    def _model_ready(self) -> None:
        plan = self.plan
        if plan is None or self._model is None or self._model[0] != plan.model_digest or self._busy:
            return
        strategy = self.strategies.get(plan)
        check_data_fits(strategy, self.data)
        global_state = self._model[1]
        state = self.stored.state or strategy.initial_state()
        if plan.phase == "final":
            self._submit("finished", plan.round, self._finish_job, strategy, plan, global_state, state)
        elif plan.phase == "train" and self.id in plan.selected and plan.round > self.stored.done_round:
            self._set_state("training")
            self._submit("trained", plan.round, self._train_job, strategy, plan, global_state, state)

    # ---- jobs (job thread) ----------------------------------------------------------------------
    def _submit(self, kind: str, round_: int, fn: Callable[..., Any], *args: Any) -> None:
        self._busy = True

        def run() -> None:
            try:
                self.events.put(_Job(kind, round_, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 -- handed to the worker
                self.events.put(_Job(kind, round_, None, exc))

        self.jobs.submit(run)

    def _train_job(self, strategy: Any, plan: Plan, global_state: Any, state: Any) -> Upload:
        limits = [x for x in (plan.max_update_bytes, self.settings.max_update_bytes) if x > 0]
        limit = min(limits) if limits else 0
        ctx = round_context(plan, self.settings.client_index, self.device)
        upload = train_and_encode(strategy, plan, global_state, state, self.data, ctx,
                                  federation=self.creds.federation, sender=self.id,
                                  max_payload=self.creds.max_payload, max_update_bytes=limit, amp=self.settings.amp)
        self.store.save_upload(upload.blob)  # upload, then the state that names it: before publishing
        record = UploadRecord(plan.round, upload.digest, len(upload.blob))
        self.store.save(StoredState(upload.state, plan.round, record, False, self.stored.extra))
        self._publish(upload.payloads, plan.round)
        return upload

    def _publish(self, payloads: tuple[bytes, ...], round_: int) -> None:
        items = [(self.topics.update_chunk(self.id, round_, i), p, False) for i, p in enumerate(payloads)]
        shape = None if self.shaper is None else (lambda n: self.sleep(self.shaper(n, "up")))  # type: ignore[misc]
        if not self.link.publish_all(items, self.settings.publish_timeout_s, self._stopped.is_set, shape):
            log.warning("%s: PUBACKs of round %d's update not all in after %.0f s; the ack timer takes over",
                        self.id, round_, self.settings.publish_timeout_s)

    def _resend_job(self, payloads: tuple[bytes, ...], round_: int) -> None:
        self._publish(payloads, round_)

    def _finish_job(self, strategy: Any, plan: Plan, global_state: Any, state: Any) -> float:
        ctx = round_context(plan, self.settings.client_index, self.device)
        model = strategy.personal_model(global_state, state, self.data, ctx)
        correct, total, _ = evaluate(model, self.data.test, self.device)
        meta = {"strategy": plan.strategy, "rounds": plan.rounds, "seed": plan.seed, "client": self.id,
                "client_index": self.settings.client_index}
        save_model(self.store.personal_file, float_state(model), strategy.spec, {**meta, "role": "personal"})
        save_model(self.store.global_file, global_state, strategy.spec, {**meta, "role": "global"})
        return correct / total if total else 0.0

    # ---- results, acks, timers (worker) -----------------------------------------------------------
    def _on_job(self, job: _Job) -> None:
        self._busy = False
        if job.error is not None:
            raise job.error
        if job.kind == "trained":
            up: Upload = job.result
            self.stored = StoredState(up.state, job.round, UploadRecord(job.round, up.digest, len(up.blob)), False,
                                      self.stored.extra)
            self.rounds_trained.append(job.round)
            self._pending_payloads = up.payloads
            self._attempt = 0
            self._ack_due = self.clock() + self.settings.ack_timeout_s
            self._set_state("uploading")
            log.info("%s: round %d trained and sent (%d bytes, acc before training %.4f)", self.id, job.round,
                     len(up.blob), up.eval.acc if up.eval else float("nan"))
            self._progress("trained", round=job.round, bytes=len(up.blob), acc=up.eval.acc if up.eval else None,
                           train_loss=(up.metrics or {}).get("train_loss"))
        elif job.kind == "published":
            self._ack_due = self.clock() + self._backoff()
        elif job.kind == "finished":
            self.finished = True
            self.stored.finished = True
            self.store.save(self.stored)
            log.info("%s: federation finished; personal model (test acc %.4f) saved to %s", self.id, job.result,
                     self.store.personal_file)
            self._progress("finished", acc=job.result, path=str(self.store.personal_file))
            if self.settings.exit_when_finished:
                self.events.put(_Stop())
            return
        if self.plan is not None:
            self._on_plan(self.plan)  # the plan may have moved on while the job ran

    def _backoff(self) -> float:
        s = self.settings
        backoff = min(s.backoff_max_s, s.backoff_s * 2 ** self._attempt)
        return s.ack_timeout_s + backoff * (1 + self.rng.uniform(0, 0.5))

    def _resend(self) -> None:
        up = self.stored.upload
        assert up is not None
        payloads = self._pending_payloads
        if payloads is None:
            blob = self.store.load_upload(up)
            if blob is None:
                log.warning("%s: the stored upload of round %d is gone; dropping it", self.id, up.round)
                self._settle("dropped")
                return
            payloads = tuple(chunk_blob(blob, Kind.UPDATE_CHUNK, self.creds.federation, self.id, up.round,
                                        self.creds.max_payload))
            self._pending_payloads = payloads
        self._attempt += 1
        self._ack_due = None
        self._set_state("uploading")
        log.info("%s: re-sending the update of round %d (attempt %d)", self.id, up.round, self._attempt)
        self._submit("published", up.round, self._resend_job, payloads, up.round)

    def _on_ack(self, ack: Ack) -> None:
        up = self.stored.upload
        if up is None or up.settled or ack.round != up.round or ack.update_digest != up.digest:
            return
        level = logging.INFO if ack.status in ("accepted", "duplicate") else logging.WARNING
        log.log(level, "%s: round %d update %s%s", self.id, ack.round, ack.status,
                f": {ack.reason}" if ack.reason else "")
        self._settle(ack.status)
        self._progress("ack", round=ack.round, status=ack.status, reason=ack.reason)

    def _progress(self, kind: str, **info: Any) -> None:
        if self.on_progress is not None:
            self.on_progress(kind, info)

    def _settle(self, status: str) -> None:
        assert self.stored.upload is not None
        self.stored.upload = replace(self.stored.upload, status=status)
        self.store.save(self.stored)
        self._ack_due = None
        self._pending_payloads = None
        self._set_state("idle")

    def _timers(self) -> None:
        now = self.clock()
        if now >= self._heartbeat_at and self.link.connected.is_set():
            self.link.publish(self.topics.status(self.id), self._status_payload(self._state_name), retain=True)
            self._heartbeat_at = now + self.settings.heartbeat_s
        if self._ack_due is not None and now >= self._ack_due and not self._busy:
            if self._attempt >= self.settings.retries:
                log.error("%s: no ack for round %d after %d re-sends; giving up on it", self.id,
                          self.stored.upload.round if self.stored.upload else -1, self._attempt)
                self._settle("gave_up")
            else:
                self._resend()
        if self._download is not None and now - self._last_chunk_at > self.settings.download_stall_s:
            log.warning("%s: model download stalled (%d chunks missing); subscribing again", self.id,
                        len(self._download[1].missing()))
            self._resubscribe_model()

    def _set_state(self, name: str) -> None:
        if name != self._state_name:
            self._state_name = name
            self._heartbeat_at = 0.0  # publish the change now

    def _status_payload(self, state: str) -> bytes:
        info: dict[str, str | int | float | bool] = {
            "device": str(self.device), "client_index": self.settings.client_index, "num_train": self.data.num_train}
        r = self.plan.round if self.plan is not None else 0
        return encode_message(Status(r, state, self.clock(), info), self.creds.federation, self.id)
