"""Publishing the global model and the plan, and clearing models nobody needs any more.

The global model travels as retained chunks ``model/<digest>/<i>`` (QoS 1; the broker's PUBACK is
awaited for each): a device that connects late or reconnects mid-download re-subscribes and gets
them again. The digests that may still be retained on the broker are listed in
``<state_dir>/retained.json`` *before* their chunks go out, so old models are cleared (an empty
retained payload per chunk topic) even after a crash; the current model is never cleared.

Models over HTTP (``[federation] models_dir``): each blob is also written as the file
``<models_dir>/<digest>`` (:class:`coordinator.model_files.ModelFiles`) before its chunks and the plan go
out, the plan names ``models_url``, and the files of old models are removed with their chunks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flayer.state import atomic_write
from flayer.update import state_numpy
from protocol import Kind, Plan, SigningKey, Topics, blob_digest, chunk_blob, encode_message, encode_state
from protocol.upload_cap import UploadCap
from transport.link import MqttLink

from .config import CoordinatorConfig
from .model_files import ModelFiles

__all__ = ["ModelBlob", "Publisher", "StopRequested", "make_plan", "model_blob"]

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """A stop was requested while waiting for the broker."""


@dataclass(frozen=True)
class ModelBlob:
    blob: bytes
    digest: str

    @property
    def size(self) -> int:
        return len(self.blob)


def model_blob(state: Mapping[str, torch.Tensor]) -> ModelBlob:
    """The global model's safetensors blob (deterministic) and the digest that names it."""
    blob = encode_state(state_numpy(state))
    return ModelBlob(blob, blob_digest(blob))


def make_plan(cfg: CoordinatorConfig, strategy: str, options: Mapping[str, Any], number: int,
              selected: Iterable[str], deadline: float, model: ModelBlob, chunks: int, phase: str = "train") -> Plan:
    """The round plan: everything a device needs to run the same strategy code as the simulator."""
    fs = cfg.federation
    return Plan(round=number, selected=tuple(sorted(selected)), deadline=deadline, strategy=strategy,
                options=dict(options), model=dict(dataclasses.asdict(cfg.spec)), model_digest=model.digest,
                model_chunks=chunks, model_size=model.size, value_codec=fs.value_codec, compress=fs.compress,
                phase=phase, seed=cfg.run.seed, train=cfg.train_plan, rounds=cfg.run.rounds,
                max_update_bytes=fs.max_update_bytes, mode=fs.mode,
                max_staleness=fs.async_settings.max_staleness if fs.mode == "async" else 0,
                upload_fit=UploadCap(fs.fit_lowest_codec, fs.fit_min_keep).as_plan(),
                models_url=fs.models_url if cfg.models_dir is not None else "")


class Publisher:
    def __init__(self, link: MqttLink, topics: Topics, sender: str, max_payload: int, state_dir: Path,
                 timeout_s: float, cancelled: Callable[[], bool], files: ModelFiles | None = None,
                 key: SigningKey | None = None) -> None:
        self.link = link
        self.key = key  # the coordinator's: every chunk and plan it publishes is signed
        self.files = files  # models over HTTP: each blob also as <models_dir>/<digest>
        self.topics = topics
        self.sender = sender
        self.max_payload = max_payload
        self.record = state_dir / "retained.json"
        self.timeout_s = timeout_s
        self.cancelled = cancelled
        self.live: str | None = None  # digest published by this process
        self.companions: set[str] = set()  # blobs retained beside it (the deltas to it), published by this process
        self._issued = 0.0  # the last plan's ``issued``

    def _retained(self) -> dict[str, int]:
        try:
            data = json.loads(self.record.read_text())
            return {str(k): int(v) for k, v in data.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable %s (%s)", self.record, exc)
            return {}

    def forget(self) -> None:
        """The broker may have lost what this process published (it restarted): publish it again."""
        self.live = None
        self.companions = set()

    def _wait(self, infos: list[Any], what: str) -> None:
        while not self.link.wait_published(infos, self.timeout_s, self.cancelled):
            if self.cancelled():
                raise StopRequested(what)
            log.warning("broker has not acknowledged %s after %.0f s; still waiting", what, self.timeout_s)

    def model(self, model: ModelBlob, round_: int, shaper: Callable[[int], None] | None = None,
              companion: bool = False) -> tuple[int, int]:
        """Publish ``model`` as retained chunks unless this process already did; returns
        (chunk count, bytes published). ``companion``: a blob kept retained beside the live model
        (a delta to it) instead of the model itself. With ``files``, the blob is written there first."""
        chunks = chunk_blob(model.blob, Kind.MODEL_CHUNK, self.topics.federation, self.sender, round_,
                            self.max_payload, model.digest, key=self.key)
        if self.files is not None and self.files.write(model.digest, model.blob):  # before the plan names it
            log.info("model file %s written (%d bytes)", self.files.path(model.digest), model.size)
        if (model.digest in self.companions) if companion else self.live == model.digest:
            return len(chunks), 0
        retained = self._retained()
        retained[model.digest] = len(chunks)
        atomic_write(self.record, json.dumps(retained, sort_keys=True).encode())
        infos = []
        for i, payload in enumerate(chunks):
            if shaper is not None:
                shaper(len(payload))
            infos.append(self.link.publish(self.topics.model_chunk(model.digest, i), payload, retain=True))
        self._wait(infos, f"model {model.digest[:12]} ({len(chunks)} chunks)")
        if companion:
            self.companions.add(model.digest)
        else:
            self.live = model.digest
        return len(chunks), sum(len(p) for p in chunks)

    def plan(self, plan: Plan) -> int:
        # issued: strictly later for every plan this process publishes, so a device given an earlier plan of the
        # same round again (an async slot change undone, a deadline before its extension) refuses it
        self._issued = max(time.time(), self._issued + 1e-6)
        plan = dataclasses.replace(plan, issued=self._issued)
        payload = encode_message(plan, self.topics.federation, self.sender, key=self.key)
        self._wait([self.link.publish(self.topics.round(), payload, retain=True)], f"plan of round {plan.round}")
        return len(payload)

    def clear_old_models(self) -> int:
        """Empty the retained chunks of every recorded model but the live one (and its companions), and
        remove their files (models over HTTP); returns how many models were cleared."""
        retained = self._retained()
        if self.files is not None and self.live is not None:  # models over HTTP: the old files go with them
            self.files.prune({self.live, *self.companions})
        old = {d: n for d, n in retained.items() if d != self.live and d not in self.companions}
        infos = [self.link.publish(self.topics.model_chunk(d, i), b"", retain=True) for d, n in old.items()
                 for i in range(n)]
        if infos:
            self._wait(infos, f"clearing {len(old)} old model(s)")
            atomic_write(self.record, json.dumps({d: n for d, n in retained.items() if d not in old}).encode())
        return len(old)
