"""Delta downloads on the coordinator: with each new global model, the change from the previous one.

``[federation] delta_downloads`` = exact | fp16 | int8 (off by default). When a round closes,
:meth:`DeltaChain.advance` codes the change from the model the round started from to the new one
(:func:`protocol.model_delta.make_delta`). In a lossy mode the new global model *is* the
reconstruction ``old + decoded delta`` (:func:`protocol.model_delta.apply_delta`, the function the
devices run), so coordinator and devices hold the same bits; the checkpoint saves that model. The
delta is published as retained chunks beside the model (:meth:`Publisher.model` with
``companion``) and named in the plan's ``delta`` field, but only when its blob is smaller than the
model's. One delta is kept: from the directly previous model. After a coordinator restart there
is none until the next round closes (devices then take the full model).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from flayer.update import state_numpy
from protocol import UpdateHeader, blob_digest
from protocol.model_delta import DeltaRef, apply_delta, make_delta

from .publish import ModelBlob, Publisher, model_blob

__all__ = ["DeltaChain"]

log = logging.getLogger(__name__)


class DeltaChain:
    def __init__(self, mode: str, federation: str, sender: str) -> None:
        self.mode, self.federation, self.sender = mode, federation, sender
        self.blob: ModelBlob | None = None  # the delta blob to the current model
        self.base = self.target = ""  # digests it goes from / to
        self.chunks = 0  # its chunk count once published

    def advance(self, old: ModelBlob | None, old_state: Mapping[str, torch.Tensor],
                new_state: dict[str, torch.Tensor], round_: int) -> tuple[dict[str, torch.Tensor], ModelBlob]:
        """The next global model (the reconstruction in a lossy mode) and its blob; the delta to it
        from ``old`` is kept for :meth:`publish` when it is smaller than the model."""
        self.blob, self.chunks = None, 0
        if self.mode == "off" or old is None:
            return new_state, model_blob(new_state)
        base, target = state_numpy(old_state), state_numpy(new_state)
        blob = make_delta(base, target, self.mode, UpdateHeader(self.federation, round_, self.sender, old.digest))
        if self.mode != "exact":  # the published model is defined as the reconstruction
            new_state = {k: torch.from_numpy(v) for k, v in apply_delta(base, blob, old.digest).items()}
        model = model_blob(new_state)
        if len(blob) < model.size:
            self.blob, self.base, self.target = ModelBlob(blob, blob_digest(blob)), old.digest, model.digest
        log.info("round %d: delta from %s is %d bytes, the model %d (%s)", round_, old.digest[:12], len(blob),
                 model.size, "offered" if self.blob is not None else "not smaller: full model only")
        return new_state, model

    def publish(self, publisher: Publisher, model: ModelBlob, round_: int) -> int:
        """Publish the delta to ``model`` (retained, beside it) if there is one; bytes published."""
        if self.blob is None or self.target != model.digest:
            publisher.companion = None  # an older delta is cleared with the old models
            return 0
        self.chunks, nbytes = publisher.model(self.blob, round_, companion=True)
        return nbytes

    def plan_field(self, model_digest: str) -> dict[str, str | int]:
        """The plan's ``delta`` field for a plan naming ``model_digest`` (empty when none is offered)."""
        if self.blob is None or self.chunks == 0 or self.target != model_digest:
            return {}
        return DeltaRef(self.base, self.blob.digest, self.chunks, self.blob.size).as_plan()
