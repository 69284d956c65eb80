"""Delta downloads on the coordinator: with each new global model, the change from the previous one.

``[federation] delta_downloads`` = exact | fp16 | int8 (off by default). When a round closes,
:meth:`DeltaChain.advance` codes the change from the model the round started from to the new one
(:func:`protocol.model_delta.make_delta`). In a lossy mode the new global model *is* the
reconstruction ``old + decoded delta`` (:func:`protocol.model_delta.apply_delta`, the function the
devices run), so coordinator and devices hold the same bits; the checkpoint saves that model. The
delta is published as retained chunks beside the model (:meth:`Publisher.model` with
``companion``) and named in the plan's ``delta`` field, but only when its blob is smaller than the
model's. The chain keeps the deltas of the last ``CHAIN`` versions (the plan's ``delta_chain`` names
the older ones), so a device that missed a few rounds still rebuilds the model from the one it
holds, delta by delta. After a coordinator restart the chain starts empty (devices take the full
model until the next round closes). A round that leaves the model as it was (it folded nothing) adds
no link; a change the lossy mode cannot hold travels as an exact delta (:meth:`DeltaChain.advance`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from flayer.update import state_numpy
from protocol import EncodeError, UpdateHeader, WireError, blob_digest
from protocol.model_delta import CHAIN, DeltaRef, apply_delta, chain_entry, make_delta

from .publish import ModelBlob, Publisher, model_blob

__all__ = ["DeltaChain"]

log = logging.getLogger(__name__)


@dataclass
class _Link:
    blob: ModelBlob  # the delta blob
    base: str  # digest of the model it starts from
    target: str  # digest of the model it rebuilds
    chunks: int = 0  # its chunk count once published


class DeltaChain:
    """The deltas to the current model: the newest from the previous model, and before it up to
    ``CHAIN - 1`` older ones, each from its version to the next, so a device holding any of the last
    ``CHAIN`` models rebuilds the current one step by step."""

    def __init__(self, mode: str, federation: str, sender: str) -> None:
        self.mode, self.federation, self.sender = mode, federation, sender
        self.links: list[_Link] = []  # oldest first; the last one ends at the current model

    # the newest link, by the names of a one-delta chain
    @property
    def blob(self) -> ModelBlob | None:
        return self.links[-1].blob if self.links else None

    @blob.setter
    def blob(self, value: ModelBlob) -> None:
        self.links[-1].blob = value

    @property
    def base(self) -> str:
        return self.links[-1].base if self.links else ""

    @property
    def target(self) -> str:
        return self.links[-1].target if self.links else ""

    @property
    def chunks(self) -> int:
        return self.links[-1].chunks if self.links else 0

    @chunks.setter
    def chunks(self, value: int) -> None:
        self.links[-1].chunks = value

    def advance(self, old: ModelBlob | None, old_state: Mapping[str, torch.Tensor],
                new_state: dict[str, torch.Tensor], round_: int) -> tuple[dict[str, torch.Tensor], ModelBlob]:
        """The next global model (the reconstruction in a lossy mode) and its blob. Rules, in order:

        1. no delta mode, or no previous model: the chain starts over;
        2. the delta from ``old`` in the chain's mode; one that mode cannot hold (a change beyond fp16's
           range or float32's, a reconstruction that is not finite) is sent exact instead, with a log
           line saying why;
        3. a model whose digest is ``old``'s (a round that folded nothing): the chain is kept as it is,
           no link from a model to itself is ever added (a device would rebuild the model it holds);
        4. a delta smaller than the model joins the chain; a larger one starts the chain over."""
        if self.mode == "off" or old is None:
            self.links = []
            return new_state, model_blob(new_state)
        base, target = state_numpy(old_state), state_numpy(new_state)
        header = UpdateHeader(self.federation, round_, self.sender, old.digest)
        blob, rebuilt = self._coded(base, target, header)
        if rebuilt is not None:  # lossy: the published model is defined as the reconstruction
            new_state = {k: torch.from_numpy(v) for k, v in rebuilt.items()}
        model = model_blob(new_state)
        if model.digest == old.digest:
            log.info("round %d: the model is unchanged (%s); the delta chain is kept as it is (%d links)",
                     round_, old.digest[:12], len(self.links))
            return new_state, model
        if len(blob) < model.size:
            kept = self.links if self.links and self.links[-1].target == old.digest else []
            self.links = [*kept, _Link(ModelBlob(blob, blob_digest(blob)), old.digest, model.digest)][-CHAIN:]
        else:
            self.links = []
        log.info("round %d: delta from %s is %d bytes, the model %d (%s)", round_, old.digest[:12], len(blob),
                 model.size, f"offered, a chain of {len(self.links)}" if self.links else "not smaller: full model only")
        return new_state, model

    def _coded(self, base: dict[str, np.ndarray], target: dict[str, np.ndarray],
               header: UpdateHeader) -> tuple[bytes, dict[str, np.ndarray] | None]:
        """(the delta blob, the reconstruction in a lossy mode else None), exact when the chain's lossy
        mode cannot hold this change (rule 2)."""
        if self.mode != "exact":
            try:
                blob = make_delta(base, target, self.mode, header)
                return blob, apply_delta(base, blob, header.base_digest)
            except (EncodeError, WireError) as exc:
                log.warning("round %d: the %s delta cannot hold this change (%s); sending it exact",
                            header.round, self.mode, exc)
        return make_delta(base, target, "exact", header), None  # codes any two finite models

    def publish(self, publisher: Publisher, model: ModelBlob, round_: int) -> int:
        """Publish the chain's deltas (retained, beside ``model``) that are not yet; bytes published.
        Deltas that left the chain are cleared with the old models."""
        if not self.links or self.links[-1].target != model.digest:
            publisher.companions.clear()
            return 0
        publisher.companions &= {link.blob.digest for link in self.links}
        total = 0
        for link in self.links:
            link.chunks, nbytes = publisher.model(link.blob, round_, companion=True)
            total += nbytes
        return total

    def plan_field(self, model_digest: str) -> dict[str, str | int]:
        """The plan's ``delta`` field for a plan naming ``model_digest``: the newest delta (empty when none)."""
        if not self.links or self.chunks == 0 or self.target != model_digest:
            return {}
        return DeltaRef(self.base, self.blob.digest, self.chunks, self.blob.size).as_plan()  # type: ignore[union-attr]

    def chain_field(self, model_digest: str) -> tuple[str, ...]:
        """The plan's ``delta_chain``: the older deltas, oldest first (:func:`protocol.model_delta.chain_entry`)."""
        if not self.plan_field(model_digest):
            return ()
        return tuple(chain_entry(DeltaRef(x.base, x.blob.digest, x.chunks, x.blob.size, x.target))
                     for x in self.links[:-1] if x.chunks > 0)
