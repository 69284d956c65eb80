"""``flayer simulate``'s thin-link options as :class:`flayer.links.LinkHooks`: what devices send and
receive, coded by the same wire code as the MQTT stack.

Up: each selected client's update gets its error-feedback residual added (``--error-feedback``,
kept per client in memory), keeps the largest ``--keep`` share of each tensor's masked coordinates,
and is coded with ``--value-codec`` (and ``--zstd``); the server folds the values as decoded
(:func:`edge_client.linkfit.prepare_upload`, :func:`edge_client.residual.as_decoded`: the device's
own code). With ``upload = "fit"`` (``flayer emulate --virtual``, which knows each device's link and
the round's expected close) an upload given a byte budget is fitted to it as the edge client fits it
(:func:`edge_client.linkfit.fit_upload`: down the codec ladder to ``cap.lowest``, then a top-k share
no smaller than ``cap.min_keep``). Down: a client holding a model the coordinator's delta chain
starts from receives the chain's deltas from there to the current model (``--delta-downloads``,
:class:`coordinator.deltas.DeltaChain`: the coordinator's code, the lossy modes publish the
reconstruction), one holding the current model nothing, any other the whole model. Bytes are the
blobs' sizes (update blob, model or delta blob), without the MQTT chunk framing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flayer.links import LinkHooks
from flayer.update import Update
from protocol.upload_cap import UploadCap

__all__ = ["ThinLinks", "ThinOptions", "link_hooks"]


@dataclass(frozen=True)
class ThinOptions:
    value_codec: str = "fp32"
    keep: float = 1.0
    error_feedback: bool = False
    delta_downloads: str = "off"
    zstd: bool = False
    fit: bool = False  # [edge] upload = "fit": an upload given a budget is fitted to it
    cap: UploadCap = field(default_factory=UploadCap)  # how far a fitted upload may go ([federation] fit_lowest_codec, fit_min_keep)

    def __post_init__(self) -> None:
        from protocol import VALUE_CODECS
        from protocol.model_delta import DELTA_MODES

        if self.value_codec not in VALUE_CODECS:
            raise ValueError(f"value codec must be one of {', '.join(VALUE_CODECS)}, got {self.value_codec!r}")
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.delta_downloads not in DELTA_MODES:
            raise ValueError(f"delta downloads must be one of {', '.join(DELTA_MODES)}, got {self.delta_downloads!r}")
        if self.fit and (problem := self.cap.problems()) is not None:
            raise ValueError(f"upload fit: {problem}")


class ThinLinks:
    def __init__(self, opts: ThinOptions, initial: Mapping[str, torch.Tensor]) -> None:
        from coordinator.deltas import DeltaChain
        from coordinator.publish import model_blob
        from protocol import UpdateHeader

        self.opts = opts
        self.header = UpdateHeader("federation", 1, "client-0000", "0" * 64)
        self.residual: dict[int, dict[str, np.ndarray]] = {}
        self.chain = DeltaChain(opts.delta_downloads, "federation", "coordinator")
        self.model = model_blob(initial)  # the current global model's blob
        self.held: dict[int, str] = {}  # client -> digest of the model it holds
        self.last_fit: Any = None  # the choice of the last fitted upload (edge_client.linkfit.Fit)

    @property
    def fit(self) -> bool:
        """Uploads given a budget are fitted to it (``[edge] upload = "fit"``)."""
        return self.opts.fit

    def _size(self, update: Update, codec: str) -> int:
        from protocol import UpdateOptions, encode_update

        return len(encode_update(update, self.header, UpdateOptions(codec, zstd=self.opts.zstd)))

    def upload(self, r: int, client: int, update: Update, budget: int = 0,
               unmeasured: bool = False) -> tuple[Update, int]:
        """(the update as the server decodes it, its bytes); ``budget`` > 0 with ``fit``: fitted to it;
        ``unmeasured`` with ``fit``: the device's link is not measured yet, so it sends with the lowest codec
        the plan allows, all of its coordinates (as :class:`edge_client.thin.ThinUploads` does)."""
        from edge_client.linkfit import prepare_upload
        from edge_client.residual import as_decoded
        from flayer.aggregate import UpdateError
        from protocol import EncodeError, WireError

        o = self.opts
        residual = self.residual.get(client, {}) if o.error_feedback else None
        try:
            blind = o.fit and unmeasured and budget <= 0
            fit = o.fit and (budget > 0 or blind)
            sent, options, self.last_fit, nxt = prepare_upload(
                update, codec=o.cap.lowest if blind else o.value_codec, zstd=o.zstd, cap=o.cap if fit else None,
                fit=fit, budget=(1 << 62 if blind else budget) if fit else 0, residual=residual,
                size_of=self._size, keep=o.keep)
            decoded, size = as_decoded(sent, options.values), self._size(sent, options.values)
        except (EncodeError, WireError) as exc:  # e.g. non-finite values: refused as the server would
            raise UpdateError(f"the update cannot go on the wire: {exc}") from None
        if nxt is not None:
            self.residual[client] = nxt
        return decoded, size

    def publish(self, r: int, old: Mapping[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state, self.model = self.chain.advance(self.model, old, new, r + 1)
        return state

    def download(self, r: int, client: int, hold: bool = True) -> int:
        """Bytes client ``client`` receives to hold the current model (round ``r``'s): nothing when it holds
        it already, the chain's deltas from the model it holds when the chain starts from there
        (:class:`coordinator.deltas.DeltaChain` keeps the last protocol.model_delta.CHAIN), else the model.
        ``hold``: the client holds the current model afterwards (False: only the bytes, e.g. for a
        download that may not complete)."""
        held = self.held.get(client)
        if hold:
            self.held[client] = self.model.digest
        if held == self.model.digest:
            return 0
        links = self.chain.links
        for k, link in enumerate(links):
            if link.base == held and links[-1].target == self.model.digest:
                walk = sum(x.blob.size for x in links[k:])  # as a device does (edge_client.delta_fetch, rule 4):
                return walk if walk < self.model.size else self.model.size  # the model when it costs less
        return self.model.size


def link_hooks(opts: ThinOptions, initial: Mapping[str, torch.Tensor]) -> LinkHooks:
    """The hooks for ``opts``, starting from the global model ``initial``."""
    links = ThinLinks(opts, initial)
    return LinkHooks(links.upload, links.publish, links.download)
