"""``flayer simulate``'s thin-link options as :class:`flayer.links.LinkHooks`: what devices send and
receive, coded by the same wire code as the MQTT stack.

Up: each selected client's update gets its error-feedback residual added (``--error-feedback``,
kept per client in memory), keeps the largest ``--keep`` share of each tensor's masked coordinates,
and is coded with ``--value-codec`` (and ``--zstd``); the server folds the values as decoded
(:func:`edge_client.linkfit.prepare_upload`, :func:`edge_client.residual.as_decoded`: the device's
own code). Down: a selected client holding the previous round's model receives the delta to the
new one (``--delta-downloads``, :class:`coordinator.deltas.DeltaChain`: the coordinator's code, the
lossy modes publish the reconstruction), when it is smaller, else the whole model. Bytes are the
blobs' sizes (update blob, model or delta blob), without the MQTT chunk framing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from flayer.links import LinkHooks
from flayer.update import Update

__all__ = ["ThinOptions", "link_hooks"]


@dataclass(frozen=True)
class ThinOptions:
    value_codec: str = "fp32"
    keep: float = 1.0
    error_feedback: bool = False
    delta_downloads: str = "off"
    zstd: bool = False

    def __post_init__(self) -> None:
        from protocol import VALUE_CODECS
        from protocol.model_delta import DELTA_MODES

        if self.value_codec not in VALUE_CODECS:
            raise ValueError(f"value codec must be one of {', '.join(VALUE_CODECS)}, got {self.value_codec!r}")
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.delta_downloads not in DELTA_MODES:
            raise ValueError(f"delta downloads must be one of {', '.join(DELTA_MODES)}, got {self.delta_downloads!r}")


class _Links:
    def __init__(self, opts: ThinOptions, initial: Mapping[str, torch.Tensor]) -> None:
        from coordinator.deltas import DeltaChain
        from coordinator.publish import model_blob
        from protocol import UpdateHeader

        self.opts = opts
        self.header = UpdateHeader("federation", 1, "client-0000", "0" * 64)
        self.residual: dict[int, dict[str, np.ndarray]] = {}
        self.chain = DeltaChain(opts.delta_downloads, "federation", "coordinator")
        self.model = model_blob(initial)  # the current global model's blob
        self.delta_bytes: dict[int, int] = {}  # round -> bytes of the delta from round - 1's model
        self.held: dict[int, int] = {}  # client -> round of the model it holds

    def _size(self, update: Update, codec: str) -> int:
        from protocol import UpdateOptions, encode_update

        return len(encode_update(update, self.header, UpdateOptions(codec, zstd=self.opts.zstd)))

    def upload(self, r: int, client: int, update: Update) -> tuple[Update, int]:
        from edge_client.linkfit import prepare_upload
        from edge_client.residual import as_decoded

        from flayer.aggregate import UpdateError
        from protocol import EncodeError, WireError

        o = self.opts
        residual = self.residual.get(client, {}) if o.error_feedback else None
        try:
            sent, options, _, nxt = prepare_upload(update, codec=o.value_codec, zstd=o.zstd, cap=None, fit=False,
                                                   budget=0, residual=residual, size_of=self._size, keep=o.keep)
            decoded, size = as_decoded(sent, options.values), self._size(sent, options.values)
        except (EncodeError, WireError) as exc:  # e.g. non-finite values: refused as the server would
            raise UpdateError(f"the update cannot go on the wire: {exc}") from None
        if nxt is not None:
            self.residual[client] = nxt
        return decoded, size

    def publish(self, r: int, old: Mapping[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state, self.model = self.chain.advance(self.model, old, new, r + 1)
        if self.chain.blob is not None:
            self.delta_bytes[r + 1] = self.chain.blob.size
        else:  # the chain starts over: no older delta is kept
            self.delta_bytes.clear()
        return state

    def download(self, r: int, client: int) -> int:
        """Bytes client ``client`` receives for round ``r``'s model: the chain of deltas from the version it
        holds when the coordinator still keeps them all (protocol.model_delta.CHAIN), else the model."""
        from protocol.model_delta import CHAIN

        held, self.held[client] = self.held.get(client), r
        steps = range(held + 1, r + 1) if held is not None else range(0)
        if held is not None and 1 <= r - held <= CHAIN and all(k in self.delta_bytes for k in steps):
            return sum(self.delta_bytes[k] for k in steps)
        return self.model.size


def link_hooks(opts: ThinOptions, initial: Mapping[str, torch.Tensor]) -> LinkHooks:
    """The hooks for ``opts``, starting from the global model ``initial``."""
    links = _Links(opts, initial)
    return LinkHooks(links.upload, links.publish, links.download)
