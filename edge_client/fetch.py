"""The edge client's model fetch: the global model a plan names, from the model this device holds
(no download), from a delta against it (thin links, :mod:`edge_client.delta_fetch`) or from the
model's retained chunks (:class:`edge_client.download.ModelDownload`); once it is whole and its
digest checked, :meth:`_model_ready` starts the round's job. Models over HTTP: when the plan names a
``models_url`` (and ``[edge] http_models`` is on), a model or delta is first fetched from
``<models_url>/<digest>`` on a thread of its own (:mod:`edge_client.http_fetch`: range requests,
resumed from the partial file in the state folder) without subscribing to its chunks; any failure is
logged with its reason, reported as an ``http_fallback`` progress event, and the same blob is then
downloaded from the broker's retained chunks (HTTP is not tried again for that digest). The fetch is bounded: at most
``MAX_DELTA_STEPS`` delta downloads towards one plan's model, and any delta refused or never coming,
lead to the full model (which always ends the fetch). A mixin of
:class:`edge_client.client.EdgeClient`, which holds the state (see its docstring); runs on the
client's worker thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol import Plan, Topics, WireError, WireLimits
from protocol.model_delta import CHAIN, DeltaRef
from transport.link import MqttLink
from transport.models_auth import authorization, token_destination_problem

from .delta_fetch import HeldModel, delta_source, rebuild
from .download import ModelDownload
from .http_fetch import HttpFetchError, HttpTarget, fetch_blob, tls_context
from .work import EdgeError, StrategyCache, decode_global

__all__ = ["MAX_DELTA_STEPS", "HttpDone", "HttpDownload", "ModelFetch"]

log = logging.getLogger("edge_client.client")

MAX_DELTA_STEPS = CHAIN  # delta downloads towards one plan's model, then the full model: a chain has CHAIN links


@dataclass
class HttpDownload:
    """A fetch over HTTP under way on its own thread (models over HTTP)."""

    digest: str
    chunks: int  # the blob's chunk count, for the fallback to the broker
    started: float
    stop: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.stop.set()


@dataclass(frozen=True)
class HttpDone:
    """The worker's event once an HTTP fetch ended: the blob and its stats, or why it failed."""

    fetch: HttpDownload
    blob: bytes | None
    stats: dict[str, Any]
    error: HttpFetchError | None = None


class ModelFetch:
    """Fetching the plan's model (see module docstring)."""

    id: str
    link: MqttLink
    topics: Topics
    limits: WireLimits
    trust: Any  # the coordinator's key (protocol.PeerTrust): a model chunk it did not sign is refused
    plan: Plan | None
    strategies: StrategyCache
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    shaper: Callable[[int, str], float] | None
    _download: ModelDownload | None
    _http: HttpDownload | None = None  # models over HTTP: a fetch under way
    on_http_bytes: Callable[[int], None] | None = None  # body bytes as they come over HTTP (the emulator counts them)
    _http_failed: set[str]  # digests whose HTTP fetch failed: the broker's chunks instead
    settings: Any
    creds: Any
    events: Any
    _delta: DeltaRef | None
    _held: HeldModel
    _model: tuple[str, dict[str, torch.Tensor]] | None
    _link_kbps: float | None
    _delta_steps: tuple[str, int] = ("", 0)  # (a plan's model digest, delta downloads started towards it)

    def _set_state(self, name: str) -> None: ...
    def _progress(self, kind: str, **info: Any) -> None: ...
    def _model_ready(self) -> None: ...

    def _fetch(self, plan: Plan) -> None:
        if self._model is None and (held := self._held.load(self.limits)) is not None:  # thin links: rebooted
            try:
                self._model = (held[0], decode_global(held[1], self.strategies.get(plan), self.limits))
            except EdgeError as exc:
                log.info("%s: not using the stored model (%s)", self.id, exc)
        delta = delta_source(plan, self._model)  # thin links: the change from the model held, if offered
        steps = self._steps_towards(plan.model_digest)
        if delta is not None and steps >= MAX_DELTA_STEPS:  # bounded: the full model ends the fetch
            if self._download is None or self._download.digest != plan.model_digest:
                log.warning("%s: %d model deltas taken and model %s is still not rebuilt; downloading the full "
                            "model", self.id, steps, plan.model_digest[:12])
                self._progress("delta_refused", reason=f"{steps} deltas taken, model not rebuilt")
            delta = None
        fetching = self._download.digest if self._download is not None else \
            self._http.digest if self._http is not None else None
        if self._model is not None and self._model[0] == plan.model_digest:
            self._model_ready()
        elif fetching is None or fetching not in (plan.model_digest, delta and delta.digest):
            self._start_download(plan, delta)

    def _steps_towards(self, model_digest: str) -> int:
        """Delta downloads started towards ``model_digest`` (0 once the plan names another model)."""
        return self._delta_steps[1] if self._delta_steps[0] == model_digest else 0

    def _start_download(self, plan: Plan, delta: DeltaRef | None = None) -> None:
        if self._download is not None:
            self._download.cancel()
            self._download = None
        if self._http is not None:
            self._http.cancel()
            self._http = None
        self._delta = delta
        if delta is not None:
            self._delta_steps = (plan.model_digest, self._steps_towards(plan.model_digest) + 1)
        digest, chunks = (delta.digest, delta.chunks) if delta else (plan.model_digest, plan.model_chunks)
        size = delta.size if delta else plan.model_size
        if plan.models_url and self.settings.http_models and digest not in self._http_failed \
                and size <= self.limits.max_blob_bytes and self._token_may_go_to(plan.models_url):
            self._start_http(HttpTarget(plan.models_url, digest, size), chunks)
        else:
            self._download = ModelDownload(self.link, self.topics, digest, self.limits, self.clock(), chunks,
                                           self.trust)
        self._set_state("online")

    # ---- models over HTTP ------------------------------------------------------------------------
    def _token_may_go_to(self, url: str) -> bool:
        """Whether the plan's ``models_url`` may have this device's models token: a host its own configuration
        names, over https (transport.models_auth); otherwise the model comes over the broker, no byte sent there."""
        hosts = [self.creds.host, *([self.creds.tls.host] if self.creds.tls is not None else []),
                 *self.settings.models_hosts]
        problem = token_destination_problem(url, hosts, self.settings.models_plain_http)
        if problem is not None:
            log.warning("%s: the plan's models_url %s gets no models token (%s); the model comes over the broker",
                        self.id, url, problem)
        return problem is None

    def _start_http(self, target: HttpTarget, chunks: int) -> None:
        fetch = self._http = HttpDownload(target.digest, chunks, self.clock())
        tls = self.creds.tls
        timeout = self.settings.http_timeout_s
        # the model server lets the federation's devices in by their models token (transport.models_auth)
        auth = authorization(self.creds.username, self.creds.password) if self.creds.password else None

        def on_bytes(n: int) -> None:
            if self.on_http_bytes is not None:
                self.on_http_bytes(n)
            if self.shaper is not None:  # the emulator's link: HTTP bytes cross it as chunks do
                self.sleep(self.shaper(n, "down"))

        def run() -> None:
            try:
                ctx = tls_context(tls.ca_file if tls is not None else None) if target.url.startswith("https:") \
                    else None
                blob, stats = fetch_blob(target, self.settings.state_dir, timeout_s=timeout,
                                         deadline_s=self.settings.http_deadline_s, tls=ctx, authorization=auth,
                                         cancelled=fetch.stop.is_set, on_bytes=on_bytes)
                self.events.put(HttpDone(fetch, blob, stats))
            except HttpFetchError as exc:
                self.events.put(HttpDone(fetch, None, {}, exc))
            except Exception as exc:  # noqa: BLE001 -- any other failure also falls back to the chunks
                self.events.put(HttpDone(fetch, None, {}, HttpFetchError("error", f"{type(exc).__name__}: {exc}")))

        threading.Thread(target=run, name=f"edge-{self.id}-http", daemon=True).start()

    def _on_http_done(self, done: HttpDone) -> None:
        if done.fetch is not self._http:  # cancelled: the plan moved on
            return
        self._http = None
        if done.error is not None:
            if done.error.kind == "cancelled":
                return
            log.warning("%s: model %s over HTTP failed (%s); downloading the broker's chunks", self.id,
                        done.fetch.digest[:12], done.error.reason)
            if len(self._http_failed) > 64:
                self._http_failed.clear()
            self._http_failed.add(done.fetch.digest)
            self._progress("http_fallback", digest=done.fetch.digest, failure=done.error.kind, reason=done.error.reason)
            self._download = ModelDownload(self.link, self.topics, done.fetch.digest, self.limits, self.clock(),
                                           done.fetch.chunks, self.trust)
            return
        assert done.blob is not None
        self._downloaded(done.fetch.digest, done.blob, done.fetch.started, done.stats)

    def _on_model_chunk(self, digest: str, payload: bytes) -> None:
        if self._download is None or digest != self._download.digest:
            return
        if self.shaper is not None:
            self.sleep(self.shaper(len(payload), "down"))
        blob = self._download.add(payload, self.clock())
        if blob is None:
            return
        started, stats, self._download = self._download.started, self._download.stats(), None
        self._downloaded(digest, blob, started, stats)

    def _downloaded(self, digest: str, blob: bytes, started: float, stats: dict[str, Any]) -> None:
        """A verified blob (the plan's model, or a delta towards it) is here, from the chunks or over HTTP."""
        self._link_kbps = round(len(blob) * 8 / 1000 / max(self.clock() - started, 1e-3), 1)
        assert self.plan is not None
        if self._delta is not None and digest == self._delta.digest:  # thin links: rebuild from the delta
            assert self._model is not None  # a delta is fetched only from a model held
            stats["delta_bytes"] = len(blob)
            try:
                blob, digest = rebuild(blob, self._delta, self.plan, self._model[1], self.limits)
            except WireError as exc:
                log.warning("%s: refusing the model delta (%s); downloading the full model", self.id, exc)
                self._progress("delta_refused", reason=str(exc))
                self._start_download(self.plan)
                return
            self._delta = None
            if digest != self.plan.model_digest:  # a link of the chain: hold that version, take the next step
                self._model = (digest, decode_global(blob, self.strategies.get(self.plan), self.limits))
                self._held.save(blob)
                self._progress("delta_step", digest=digest, **stats)
                self._fetch(self.plan)
                return
        log.info("%s: model %s downloaded (%s)", self.id, digest[:12], stats)
        self._progress("downloaded", digest=digest, **stats)
        self._model = (digest, decode_global(blob, self.strategies.get(self.plan), self.limits))
        self._held.save(blob)  # thin links: kept for a delta after a reboot
        self._model_ready()
