"""The edge client: one device's MQTT session, download, local round, upload and state on disk.

Threads: paho's network thread only enqueues (:class:`transport.link.MqttLink`); the client's
worker thread owns all state and reacts to events (plan, model chunk, ack, timers); one job thread
runs what takes long -- the local round, publishing and waiting for PUBACKs -- and reports back
with an event. Many clients can live in one process (the emulator): each has its own connection,
threads and state folder, an injectable ``clock``/``sleep`` and a link ``shaper(nbytes, direction)``
that returns the delay to impose on each chunk ("up" or "down"). More emulator hooks: ``after_compute``
(called on the job thread after each local computation with its wall and thread CPU seconds, before
anything is saved or sent: the emulator stretches a slow device's compute time there), ``network``
(a :class:`transport.link.NetworkDriver` driving this client's connection instead of a paho thread)
and :meth:`EdgeClient.crash` (a power loss: no offline status, no DISCONNECT; the broker publishes the
last will, and the next instance over the same state folder resumes from disk).

Per round, when selected: fetch the model (:mod:`edge_client.fetch`: from its retained chunks or a delta,
or over HTTP when the plan names a ``models_url``) ->
local round -> encode and size check -> persist state and upload -> publish the chunks (QoS 1,
PUBACKs) -> wait for the coordinator's ack, re-sending with exponential backoff and jitter (an ack
that overtakes the publishing job is kept for it; one that comes after the device gave up still
settles the stored upload). A restarted device reloads its state and re-sends an unacknowledged upload of the current round
without training again. A ``calibrate`` plan (round 0) makes a selected device run the strategy's
``calibrate`` on the model and send the report as a Metrics message instead. After the ``final``
plan the device saves its personal model and stops.

Idle, a client holds no model, and ``model_slots`` bound how many clients of a process hold one at once
(:mod:`edge_client.slots`); the status it publishes is built by :mod:`edge_client.device_status`. ``tick_s``: the longest the worker thread
waits without an event (every timer is an event or a due time it waits for; thousands of idle clients
in one process wake less often with a longer one).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flayer.data import DataError
from flayer.train import ClientData, pick_device
from protocol import (
    Ack,
    Kind,
    PeerTrust,
    Plan,
    SignatureError,
    TopicError,
    Topics,
    WireError,
    WireLimits,
    decode_message,
)
from protocol.model_delta import DeltaRef
from transport.credentials import Credentials, CredentialsError, mqtt_connect_settings
from transport.link import Connected, Disconnected, MqttLink, NetworkDriver, Received

from .budget import DeviceBudgets
from .certified_keys import CertifiedKeys
from .config import EdgeSettings
from .delta_fetch import HeldModel
from .device_status import DeviceStatus
from .download import ModelDownload, Pending
from .fetch import HttpDone, HttpDownload, ModelFetch
from .jobs import Job, Jobs, Stop
from .peer_keys import peer_keys_for
from .runtime import TrainingRuntime
from .secure import SecureRounds, SecureSession
from .slots import HeldSlots, ModelSlots, SlotFree
from .sources import DeviceSource
from .store import DeviceStore, StoredState
from .thin import ThinUploads
from .work import (
    EdgeError,
    StrategyCache,
    check_data_fits,
)

__all__ = ["ComputeHook", "EdgeClient", "EdgeError", "LinkShaper", "ModelSlots"]

log = logging.getLogger(__name__)

LinkShaper = Callable[[int, str], float]  # (bytes, "up" | "down") -> seconds of delay
ComputeHook = Callable[[str, float, float], None]  # (kind: train | calibrate, wall s, thread CPU s)


class EdgeClient(Jobs, ModelFetch, SecureRounds, DeviceBudgets, HeldSlots, DeviceStatus):
    def __init__(self, settings: EdgeSettings, creds: Credentials, data: ClientData | DeviceSource, *,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 shaper: LinkShaper | None = None, limits: WireLimits | None = None,
                 rng: random.Random | None = None,
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None,
                 after_compute: ComputeHook | None = None, network: NetworkDriver | None = None,
                 model_slots: ModelSlots | None = None, tick_s: float = 1.0) -> None:
        if creds.role != "device":
            raise EdgeError(f"credentials of {creds.username!r} are a {creds.role}'s, not a device's")
        self.settings, self.creds = settings, creds
        # a partition's ClientData, or the device's own data (a DeviceSource), loaded for the first plan
        self.source: DeviceSource | None = data if isinstance(data, DeviceSource) else None
        self.data: ClientData | None = None if isinstance(data, DeviceSource) else data
        self.id = creds.username
        self.clock, self.sleep, self.shaper = clock, sleep, shaper
        self.after_compute = after_compute
        self.limits = limits or WireLimits()
        self.rng = rng or random.Random(f"{creds.federation}/{self.id}")  # protects nothing: re-send backoff jitter
        self.on_progress = on_progress  # on the worker thread: downloaded, trained, calibrated, ack, finished
        self.topics = Topics(creds.federation)
        self.device = pick_device("cpu" if settings.runtime == "executorch" else settings.device)
        self.runtime = TrainingRuntime(settings.runtime, self.id)
        self.store = DeviceStore(settings.state_dir)
        self.stored: StoredState = self.store.load()
        self.store.release(self.stored)  # read back when a round needs it
        self.thin = ThinUploads(settings, clock)  # thin links: uplink rate, residual, per-round upload choice
        self.strategies = StrategyCache({"device": str(self.device), "threads": settings.threads,
                                         "amp": settings.amp}, settings.allow_entry_points)
        self.events: queue.Queue[Any] = queue.Queue()
        try:  # every message this device sends is signed with its key; it believes only the coordinator's
            self.signer, coordinator = creds.signer(), creds.coordinator()
        except CredentialsError as exc:
            raise EdgeError(str(exc)) from None
        try:
            self.trust = PeerTrust(creds.federation, coordinator)
            # the other devices' keys (secure rounds' signatures): certified by the kit's authority, or a registry
            self.peers = peer_keys_for(creds, Path(settings.state_dir))
        except SignatureError as exc:
            raise EdgeError(f"{creds.username}: {exc}") from None
        self._plan_round = max(self.stored.done_round, self.stored.upload.round if self.stored.upload else 0,
                               self.store.plan_round())  # the newest plan taken, across reboots
        self._issued = 0.0  # when the newest plan taken was issued (a later one of its round comes later)
        self._since = 0.0  # the time of this connection's will: every status names it (coordinator.registry)
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=False,
                             will=self._connection_will, keepalive=settings.keepalive_s, network=network)
        self.jobs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"edge-{self.id}-job")
        self.plan: Plan | None = None
        self._secure: SecureSession | None = None  # a secure round's keys and shares, in memory only
        self.error: BaseException | None = None
        self.finished = self.stored.finished
        self.rounds_trained: list[int] = []
        self.skipped: dict[int, str] = {}  # rounds this device could not train, and why (SkipRound)
        self._private_federation: bool | None = None  # None: no training plan seen yet (its status: as private)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = False  # a job is running
        self._download: ModelDownload | None = None
        self._http: HttpDownload | None = None  # models over HTTP: a fetch under way (edge_client.fetch)
        self._http_failed: set[str] = set()  # ... and the digests that fell back to the broker's chunks
        self._delta: DeltaRef | None = None  # thin links: the delta being downloaded instead of the model
        self._held = HeldModel(settings.state_dir)  # thin links: the last model, a delta's base after a reboot
        self._model: tuple[str, dict[str, torch.Tensor]] | None = None
        self._pending: Pending | None = None  # sent, not acknowledged yet
        self._early_acks: list[Ack] = []  # acks that came while the job that sent their message still ran
        self._heartbeat_at = 0.0
        self._announcing: dict[str, int | float] = {}
        self._state_name = "online"
        self._link_kbps: float | None = None  # the last model download's rate (the status carries it)
        self._crashed = False
        self.tick_s = tick_s  # the longest the worker waits for an event before it looks at its timers again
        self._init_slots(model_slots)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.link.start()
        self._thread = threading.Thread(target=self._loop, name=f"edge-{self.id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker, publish a retained ``offline`` status and disconnect cleanly."""
        self.events.put(Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def crash(self, timeout: float = 10.0) -> None:
        """Emulate a power loss: the connection drops without a DISCONNECT or an ``offline`` status
        (the broker publishes the last will) and the worker stops. A local round under way finishes
        computing but saves and sends nothing. A new instance over the same ``state_dir`` is the
        rebooted device: it resumes from what is on disk."""
        self._crashed = True
        self.link.abort()
        self.events.put(Stop())
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
                if isinstance(ev, Stop):
                    break
                self._handle(ev)
                self._release_idle()
                self._timers()
        except EdgeError as exc:  # a stop its message explains in one line (e.g. refused by the broker)
            if not self._crashed:
                log.error("%s", exc)
                self.error = exc
        except BaseException as exc:  # reported through self.error / run()
            if not self._crashed:  # after crash() the link is gone: nothing to report
                log.exception("%s: %s", self.id, exc)
                self.error = exc
        finally:
            if self._http is not None:
                self._http.cancel()
            if not self._crashed:
                self.link.stop(final=(self.topics.status(self.id), self._status_payload("offline"), True))
            self.jobs.shutdown(wait=False, cancel_futures=True)
            self._close_slot()
            self._stopped.set()

    def _next_event(self) -> Any:
        now = self.clock()
        due = [now + self.tick_s]
        # timers that can fire now only: a heartbeat needs the link (Connected is an event), a re-send waits
        # for the job in progress (its end is an event); a past timer that cannot fire would spin this loop
        if self.link.connected.is_set():
            due.append(self._heartbeat_at)
        if self._pending is not None and self._pending.due is not None and not self._busy:
            due.append(self._pending.due)
        if self._download is not None:
            due.append(self._download.due(self.settings.download_stall_s))
        try:
            return self.events.get(timeout=min(self.tick_s, max(0.0, min(due) - now)))
        except queue.Empty:
            return None

    # ---- events -------------------------------------------------------------------------------
    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Received):
            self._on_message(ev)
        elif isinstance(ev, Connected):
            if not ev.ok and ev.certificate:  # TLS: refused again and again at the handshake (transport.tls_refusal)
                raise EdgeError(f"{self.id}: the broker refused this device's TLS certificate ({ev.reason}); "
                                f"ask the federation's admin for a new kit")
            if not ev.ok:
                raise EdgeError(f"{self.id}: the broker refused the connection ({ev.reason}); check the "
                                f"credentials file")
            self.link.subscribe([self.topics.round(), self.topics.ack(self.id),  # the retained plan comes again
                                 self.topics.secreq(self.id)])
            if isinstance(self.peers, CertifiedKeys):  # the authority's revocations (certificates ride in adverts)
                self.link.subscribe([self.topics.revocations()])
            if self._download is not None:  # resume: from the session's queue, or the missing chunks
                self._download.resume(self.clock(), ev.session_present)
            self._heartbeat_at = 0.0
        elif isinstance(ev, Disconnected):
            log.warning("%s: disconnected (%s); paho reconnects", self.id, ev.reason)
        elif isinstance(ev, Job):
            self._on_job(ev)
        elif isinstance(ev, SlotFree):
            self._slot_free()
        elif isinstance(ev, HttpDone):
            self._on_http_done(ev)

    def _on_message(self, ev: Received) -> None:
        if not ev.payload:
            return
        try:
            parsed = self.topics.parse(ev.topic)
            if parsed.kind == "model":
                self._on_model_chunk(parsed.digest or "", ev.payload)
            elif parsed.kind == "round":
                _, plan = decode_message(ev.payload, self.limits, Kind.PLAN, self.trust)
                assert isinstance(plan, Plan)
                if plan.round < self._plan_round or (plan.round == self._plan_round and plan.issued < self._issued):
                    raise WireError(f"plan of round {plan.round} issued {plan.issued:.3f}, after one of round "
                                    f"{self._plan_round} issued {self._issued:.3f}: plans only move forward (a replay)")
                if plan.round > self._plan_round:
                    self.store.save_plan_round(plan.round)
                self._plan_round, self._issued = plan.round, plan.issued
                self._on_plan(plan)
            elif parsed.kind == "ack":
                _, ack = decode_message(ev.payload, self.limits, Kind.ACK, self.trust)
                assert isinstance(ack, Ack)
                self._on_ack(ack)
            elif parsed.kind == "revocations" and isinstance(self.peers, CertifiedKeys):
                self.peers.offer_revocations(ev.payload)
            elif parsed.kind == "secreq" and parsed.client == self.id:
                self._on_secreq(ev.payload)  # edge_client.secure
        except (WireError, TopicError) as exc:
            log.warning("%s: ignoring a bad message on %s: %s", self.id, ev.topic, exc)

    def _on_plan(self, plan: Plan) -> None:
        self.plan = plan
        if plan.privacy or self._own_privacy():
            self._private_federation = True  # (the final plan names no privacy: still a private federation)
        elif plan.phase == "train" and self._private_federation is None:
            self._private_federation = False
        self._secure_plan(plan)  # a secure round: its keys go out at once (edge_client.secure)
        up, pend = self.stored.upload, self._pending
        if up is not None and not up.settled and plan.phase != "final" \
                and plan.round - up.round > (plan.max_staleness if plan.mode == "async" else 0):
            log.warning("%s: upload of round %d was never acknowledged; round %d is open, dropping it",
                        self.id, up.round, plan.round)
            self._settle("dropped")
            up = self.stored.upload
        if pend is not None and pend.kind == "calibration" and plan.phase != "calibrate":
            self._pending = None  # the calibration is over
        if self._busy:
            return  # the job's end looks at the plan again
        if plan.phase == "final":
            if self._finished_for(plan) and self.settings.exit_when_finished:
                self.events.put(Stop())
            elif not self._finished_for(plan):
                self._gated_fetch(plan)
        elif plan.phase == "calibrate":
            if self.id in plan.selected and self._pending is None \
                    and self.stored.extra.get("calibrated") != plan.model_digest and not self._budget_refuses(plan):
                self._gated_fetch(plan)
        elif up is not None and not up.settled and up.round <= plan.round:  # this round's, or (async) a recent one's
            if self._pending is None:  # restarted with an unacknowledged upload: send it again
                self._resume_upload(up)
        elif not self._trains_on(plan):
            self._set_state("idle")
        else:
            self._gated_fetch(plan)

    def _trains_on(self, plan: Plan) -> bool:
        """Whether this device trains on ``plan``: selected, a round it has not trained yet, and (async) a
        version after the one whose buffer took its last accepted update (the ack's ``version``): one
        update per device per version, so training on that version again would be refused ``in_buffer``."""
        if self.id not in plan.selected or plan.round <= self.stored.done_round:
            return False
        if plan.mode == "async" and plan.round <= int(self.stored.extra.get("folded_into", 0)):
            return False
        return not self._budget_refuses(plan)  # past its own privacy budget, or not private (edge_client.budget)

    def _finished_for(self, plan: Plan) -> bool:
        """True when this final plan's models are already saved. A federation extended after it finished
        (``flayer coordinator --rounds`` more) ends with a later final plan: its models are saved again."""
        return self.finished and int(self.stored.extra.get("finished_round", plan.round)) >= plan.round

    def _model_ready(self) -> None:
        plan = self.plan
        if plan is None or self._model is None or self._model[0] != plan.model_digest or self._busy:
            return
        strategy = self.strategies.get(plan)
        if self.source is not None:
            try:
                self.data = self.source.for_spec(strategy.spec)
            except DataError as exc:
                raise EdgeError(f"this device's data does not fit the federation's model: {exc}") from None
        assert self.data is not None
        check_data_fits(strategy, self.data)
        global_state = self._model[1]
        state = self.store.state_of(self.stored) or strategy.initial_state()
        if plan.phase == "final":
            self._submit("finished", plan.round, self._finish_job, strategy, plan, global_state, state)
        elif plan.phase == "calibrate":
            if self._budget_refuses(plan):  # a calibration plan that replaced a training one mid-download
                return
            self._set_state("training")
            self._submit("calibrated", plan.round, self._calibrate_job, strategy, plan, global_state)
        elif self._trains_on(plan) and plan.round not in self.skipped:
            self._set_state("training")
            self._submit("trained", plan.round, self._train_job, strategy, plan, global_state, state)

    def _progress(self, kind: str, **info: Any) -> None:
        if self.on_progress is not None:
            self.on_progress(kind, info)

    def _set_state(self, name: str) -> None:
        if name != self._state_name:
            self._state_name = name
            self._heartbeat_at = 0.0  # publish the change now
