"""The edge client's model fetch: the global model a plan names, from the model this device holds
(no download), from a delta against it (thin links, :mod:`edge_client.delta_fetch`) or from the
model's retained chunks (:class:`edge_client.download.ModelDownload`); once it is whole and its
digest checked, :meth:`_model_ready` starts the round's job. A mixin of
:class:`edge_client.client.EdgeClient`, which holds the state (see its docstring); runs on the
client's worker thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from protocol import Plan, Topics, WireError, WireLimits
from protocol.model_delta import DeltaRef
from transport.link import MqttLink

from .delta_fetch import HeldModel, delta_source, rebuild
from .download import ModelDownload
from .work import EdgeError, StrategyCache, decode_global

__all__ = ["ModelFetch"]

log = logging.getLogger("edge_client.client")


class ModelFetch:
    """Fetching the plan's model (see module docstring)."""

    id: str
    link: MqttLink
    topics: Topics
    limits: WireLimits
    plan: Plan | None
    strategies: StrategyCache
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    shaper: Callable[[int, str], float] | None
    _download: ModelDownload | None
    _delta: DeltaRef | None
    _held: HeldModel
    _model: tuple[str, dict[str, torch.Tensor]] | None
    _link_kbps: float | None

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
        if self._model is not None and self._model[0] == plan.model_digest:
            self._model_ready()
        elif self._download is None or self._download.digest not in (plan.model_digest, delta and delta.digest):
            self._start_download(plan, delta)

    def _start_download(self, plan: Plan, delta: DeltaRef | None = None) -> None:
        if self._download is not None:
            self._download.cancel()
        self._delta = delta
        self._download = ModelDownload(self.link, self.topics, delta.digest if delta else plan.model_digest,
                                       self.limits, self.clock(), delta.chunks if delta else plan.model_chunks)
        self._set_state("online")

    def _on_model_chunk(self, digest: str, payload: bytes) -> None:
        if self._download is None or digest != self._download.digest:
            return
        if self.shaper is not None:
            self.sleep(self.shaper(len(payload), "down"))
        blob = self._download.add(payload, self.clock())
        if blob is None:
            return
        started, stats, self._download = self._download.started, self._download.stats(), None
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
