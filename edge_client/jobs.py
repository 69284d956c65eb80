"""The edge client's work off its worker thread, and what follows an upload: the local round, the
calibration report and the personal model run as jobs on the job thread (each reports back with a
:class:`Job` event); publishing, re-sending with backoff and the acknowledgements settle each upload;
the worker's timers (heartbeats, re-sends, stalled downloads).
A mixin of :class:`edge_client.client.EdgeClient`, which holds the state (see its docstring)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from flayer.strategies.base import Strategy
from flayer.train import ClientData, training_engine
from protocol import Ack, Kind, Plan, chunk_blob, decode_envelope

from .download import Pending
from .store import StoredState, UploadRecord
from .work import (
    EdgeError,
    SkipRound,
    Upload,
    calibration_report,
    plan_terms,
    round_context,
    save_personal,
    train_and_encode,
)

__all__ = ["Job", "Jobs", "Stop"]

log = logging.getLogger("edge_client.client")


class Stop:
    """The worker stops (an event on its queue): stop(), crash(), or the federation finished."""


@dataclass(frozen=True)
class Job:
    kind: str  # trained | calibrated | published | finished
    round: int
    result: Any = None
    error: BaseException | None = None


class Jobs:
    """Jobs, publishing, re-sends and acknowledgements (module docstring)."""

    id: str
    settings: Any
    stored: Any
    store: Any
    creds: Any
    signer: Any  # this device's SigningKey: everything it sends is signed
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    shaper: Any
    after_compute: Any
    plan: Plan | None
    device: Any
    data: ClientData | None
    events: Any
    thin: Any
    topics: Any
    link: Any
    jobs: Any
    runtime: Any
    rng: Any
    _pending: Pending | None
    _busy: bool
    _early_acks: list[Ack]
    _crashed: bool
    _stopped: Any

    _heartbeat_at: float
    _announcing: dict[str, int | float]  # the upload announced in the status until it is answered
    _private_federation: bool | None  # edge_client.client
    _download: Any
    _delta: Any
    _state_name: str
    _status_payload: Any  # edge_client.device_status (stubs here would shadow it)
    skipped: dict[int, str]
    rounds_trained: list[int]
    finished: bool
    _secure_trained: Any  # edge_client.secure
    _secure_send_masked: Any
    _start_download: Any  # edge_client.fetch

    _record_contribution: Any  # edge_client.budget

    def _set_state(self, name: str) -> None: ...
    def _progress(self, kind: str, **info: Any) -> None: ...
    def _on_plan(self, plan: Plan) -> None: ...

    # ---- a job's report (worker) ----------------------------------------------------------------
    def _on_job(self, job: Job) -> None:
        self._busy = False
        if isinstance(job.error, SkipRound):  # a bad global model must not end the device: skip the round
            self.skipped[job.round] = str(job.error)
            log.warning("%s: skipping round %d: %s", self.id, job.round, job.error)
            self._progress("skipped", round=job.round, reason=str(job.error))
            self._set_state("idle")
            self._heartbeat_at = 0.0  # the status carrying the reason goes out now
            if self.plan is not None:
                self._on_plan(self.plan)  # the plan may have moved on while the job ran
            return
        if job.error is not None:
            raise job.error
        if job.kind == "trained" and job.result.update is not None:  # a secure round: masked when the shares are in
            self._secure_trained(job.result, job.round)
        elif job.kind == "trained":
            up: Upload = job.result
            self.stored = StoredState(up.state, job.round, UploadRecord(job.round, up.digest, len(up.blob)), False,
                                      self.stored.extra)
            self.rounds_trained.append(job.round)
            self._pending = Pending("update", job.round, up.digest, self._update_items(up.payloads, job.round))
            self._sent()
            log.info("%s: round %d trained and sent (%d bytes)", self.id, job.round, len(up.blob))
            fit = self.thin.last
            self._progress("trained", round=job.round, bytes=len(up.blob), acc=up.eval.acc if up.eval else None,
                           codec=fit.codec if fit else None, keep=fit.keep if fit else None,
                           budget=fit.budget if fit else None,
                           train_loss=(up.metrics or {}).get("train_loss"))
        elif job.kind == "calibrated":
            self._pending = job.result
            self._sent()
            self._progress("calibrated", round=job.round)
        elif job.kind == "published":
            self._sent()
        elif job.kind == "finished":
            self.finished = self.stored.finished = True
            self.stored.extra["finished_round"] = job.round
            self.store.save(self.stored)
            log.info("%s: federation finished; personal model (test acc %.4f) saved to %s", self.id, job.result,
                     self.store.personal_file)
            self._progress("finished", acc=job.result, path=str(self.store.personal_file))
            if self.settings.exit_when_finished:
                self.events.put(Stop())
            return
        early, self._early_acks = self._early_acks, []
        for ack in early:  # acks that overtook the job's report
            self._on_ack(ack)
        self._secure_send_masked()  # one waiting for the job thread
        if self.plan is not None:
            self._on_plan(self.plan)  # the plan may have moved on while the job ran

    # ---- the job thread ---------------------------------------------------------------------------
    def _submit(self, kind: str, round_: int, fn: Callable[..., Any], *args: Any) -> None:
        self._busy = True

        def run() -> None:
            try:
                engine = self.runtime.engine_for(args[0]) if args and isinstance(args[0], Strategy) else None
                with training_engine(engine):
                    self.events.put(Job(kind, round_, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 -- handed to the worker
                self.events.put(Job(kind, round_, None, exc))

        self.jobs.submit(run)

    def _train_job(self, strategy: Any, plan: Plan, global_state: Any, state: Any) -> Upload:
        limits = [x for x in (plan.max_update_bytes, self.settings.max_update_bytes) if x > 0]
        ctx = round_context(plan, self.settings.client_index, self.device)
        t0, c0 = time.perf_counter(), time.thread_time()
        upload = train_and_encode(strategy, plan, global_state, state, self._data(), ctx,
                                  federation=self.creds.federation, sender=self.id,
                                  max_payload=self.creds.max_payload, max_update_bytes=min(limits) if limits else 0,
                                  amp=self.settings.amp, key=self.signer,
                                  prepare=self.thin.prepare_for(plan, self.creds.federation, self.id),
                                  secure=bool(plan.secure))
        self._computed("train", t0, c0)
        if upload.update is not None:  # a secure round: masked and sent by the worker (edge_client.secure)
            return replace(upload, trained_under=plan_terms(plan))
        self.store.save_upload(upload.blob)  # upload, then the state that names it: before publishing
        record = UploadRecord(plan.round, upload.digest, len(upload.blob))
        self._record_contribution(plan.privacy, False, plan.round)  # a private round: in its ledger, same file
        self.store.save(StoredState(upload.state, plan.round, record, False, self.stored.extra))
        self._announce(plan.round, sum(len(p) for p in upload.payloads))
        self._publish(self._update_items(upload.payloads, plan.round))
        return upload

    def _announce(self, round_: int, nbytes: int) -> None:
        """Tell the coordinator, on the small status message, that an upload of ``nbytes`` for ``round_``
        starts now and how long it should take at the uplink rate (0: no rate known yet): a round whose
        quorum is in may wait for it, within its bound (coordinator.rounds, Announcements)."""
        rate = self.thin.rate
        if self._private_federation is not False:  # the size follows what was sent: not in a private federation
            self._announcing = {"upload_round": round_, "upload_s": 0.0}
        else:
            self._announcing = {"upload_round": round_, "upload_bytes": nbytes,
                                "upload_s": round(nbytes / rate, 3) if rate else 0.0}
        if self.link.connected.is_set():
            self.link.publish(self.topics.status(self.id), self._status_payload("uploading"), retain=True)

    def _calibrate_job(self, strategy: Any, plan: Plan, global_state: Any) -> Pending:
        ctx = round_context(plan, self.settings.client_index, self.device)
        t0, c0 = time.perf_counter(), time.thread_time()
        payload = calibration_report(strategy, plan, global_state, self._data(), ctx, amp=self.settings.amp,
                                     now=self.clock(), federation=self.creds.federation, sender=self.id,
                                     key=self.signer)
        self._computed("calibrate", t0, c0)
        items = [(self.topics.metrics(self.id), payload, False)]
        self._publish(items)
        return Pending("calibration", plan.round, decode_envelope(payload).digest, items, model=plan.model_digest)

    def _data(self) -> ClientData:
        """This device's data (loaded for the plan's model before any job is submitted)."""
        assert self.data is not None
        return self.data

    def _computed(self, kind: str, t0: float, c0: float) -> None:
        """After a local computation (job thread): the ``after_compute`` hook, then nothing more if
        the device crashed meanwhile."""
        if self.after_compute is not None:
            self.after_compute(kind, time.perf_counter() - t0, time.thread_time() - c0)
        if self._crashed:
            raise EdgeError(f"{self.id} crashed during its {kind} computation; nothing saved or sent")

    def _update_items(self, payloads: tuple[bytes, ...], round_: int) -> list[tuple[str, bytes, bool]]:
        return [(self.topics.update_chunk(self.id, round_, i), p, False) for i, p in enumerate(payloads)]

    def _publish(self, items: list[tuple[str, bytes, bool]]) -> None:
        shape = None if self.shaper is None else (lambda n: self.sleep(self.shaper(n, "up")))  # type: ignore[misc]
        t0 = self.clock()
        if self.link.publish_all(items, self.settings.publish_timeout_s, self._stopped.is_set, shape):
            self.thin.measured(sum(len(p) for _, p, _ in items), self.clock() - t0)  # thin links: the uplink rate
        else:
            log.warning("%s: PUBACKs not all in after %.0f s; the ack timer takes over", self.id,
                        self.settings.publish_timeout_s)

    def _finish_job(self, strategy: Any, plan: Plan, global_state: Any, state: Any) -> float:
        ctx = round_context(plan, self.settings.client_index, self.device)
        meta = {"client": self.id, "client_index": self.settings.client_index}
        if self._crashed:
            raise EdgeError(f"{self.id} crashed before saving its personal model")
        return save_personal(strategy, plan, global_state, state, self._data(), ctx, self.store.personal_file,
                             self.store.global_file, meta)

    def _sent(self) -> None:
        s = self.settings
        if self._pending is not None:
            self._pending.schedule(self.clock(), s.ack_timeout_s, s.backoff_s, s.backoff_max_s, self.rng)
            self._set_state("uploading")

    def _resume_upload(self, up: UploadRecord) -> None:
        blob = self.store.load_upload(up)
        if blob is None:
            log.warning("%s: the stored upload of round %d is gone; dropping it", self.id, up.round)
            self._settle("dropped")
            return
        payloads = tuple(chunk_blob(blob, Kind.UPDATE_CHUNK, self.creds.federation, self.id, up.round,
                                    self.creds.max_payload, key=self.signer))
        self._pending = Pending("update", up.round, up.digest, self._update_items(payloads, up.round))
        self._resend()

    def _resend(self) -> None:
        p = self._pending
        assert p is not None
        p.attempt += 1
        p.due = None
        self._set_state("uploading")
        log.info("%s: re-sending the %s of round %d (attempt %d)", self.id, p.kind, p.round, p.attempt)
        self._submit("published", p.round, self._publish, p.items)

    def _on_ack(self, ack: Ack) -> None:
        p, up = self._pending, self.stored.upload
        if p is not None and (ack.round, ack.update_digest) == (p.round, p.digest):
            kind = p.kind
            if ack.status == "accepted" and ack.version > 0:  # async: in that version's buffer (one per device)
                self.stored.extra["folded_into"] = max(ack.version, int(self.stored.extra.get("folded_into", 0)))
            self._settle(ack.status)
        elif up is not None and up.status == "gave_up" and (ack.round, ack.update_digest) == (up.round,
                                                                                             up.digest) \
                and not self._busy:  # a job under way writes the state file itself: saving this one would write
            # the StoredState it replaces (an older done round beside the ledger the job just booked)
            kind = "update (given up on, answered at last)"  # the coordinator was down past the re-sends
            self.stored.upload = replace(up, status=ack.status)
            self.store.save(self.stored)
        else:
            if self._busy and len(self._early_acks) < 16:  # the coordinator can answer before the job that
                self._early_acks.append(ack)  # published returns (PUBACKs in flight): keep it for then
            return
        level = logging.INFO if ack.status in ("accepted", "duplicate") else logging.WARNING
        log.log(level, "%s: round %d %s %s%s", self.id, ack.round, kind, ack.status,
                f": {ack.reason}" if ack.reason else "")
        self._progress("ack", round=ack.round, status=ack.status, reason=ack.reason)
        if self.plan is not None and self.plan.mode == "async" and not self._busy:
            self._on_plan(self.plan)  # answered: train on the newest version if this device holds a slot
            # (never on the version whose buffer took its update: edge_client.client, trains_on)

    def _timers(self) -> None:
        now = self.clock()
        if now >= self._heartbeat_at and self.link.connected.is_set():
            self.link.publish(self.topics.status(self.id), self._status_payload(self._state_name), retain=True)
            self._heartbeat_at = now + self.settings.heartbeat_s
        p = self._pending
        if p is not None and p.due is not None and now >= p.due and not self._busy:
            if p.attempt >= self.settings.retries:
                log.error("%s: no ack for the %s of round %d after %d re-sends; giving up on it", self.id, p.kind,
                          p.round, p.attempt)
                self._settle("gave_up")
            else:
                self._resend()
        d = self._download
        if d is not None and now >= d.due(self.settings.download_stall_s) and self._delta is not None \
                and d.digest == self._delta.digest and d.received == 0 and self.plan is not None:
            log.warning("%s: no chunk of the model delta came; downloading the full model", self.id)  # thin links
            self._start_download(self.plan)
        elif d is not None and now >= d.due(self.settings.download_stall_s):
            log.warning("%s: model download stalled (%d chunks missing); asking for them again", self.id,
                        len(d.missing()))
            d.resubscribe(now)

    def _settle(self, status: str) -> None:
        """The pending message (or a stored upload) is done with: acked, refused, or given up."""
        p, self._pending = self._pending, None
        self._announcing = {}
        if p is not None and p.kind == "calibration":
            self.stored.extra["calibrated"] = p.model
        elif self.stored.upload is not None:
            self.stored.upload = replace(self.stored.upload, status=status)
        self.store.save(self.stored)
        self._set_state("idle")
