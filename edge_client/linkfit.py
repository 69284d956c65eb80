"""Link-fitted uploads: the value codec and top-k share that let an update arrive before the deadline.

``[edge] upload = "fit"``: after its local round the device knows its update, the time left until
the plan's deadline and its uplink rate (``[edge] uplink_kbps``, or :func:`rate_estimate` of its own
acknowledged uploads). The byte budget is ``rate x (time left - margin) x safety``. :func:`fit_upload`
tries the codecs the plan allows (:func:`protocol.upload_cap.codec_ladder`: fp32 -> fp16 -> int8,
sizes measured by encoding) and takes the first that fits; when even the lowest does not, it keeps
the largest-magnitude share of each tensor's sent coordinates (:func:`top_share`, never below the
plan's ``min_keep``; always a subset of the strategy's masks) until it fits. Without a rate (no
upload measured yet, none configured) nothing is fitted: the lowest codec the plan allows goes, with
all the masked coordinates (:class:`edge_client.thin.ThinUploads` chooses it). What the choice
leaves out is kept by error feedback (:mod:`edge_client.residual`) when it is on.

:func:`prepare_upload` is the one step the device runs between training and encoding: residual in,
fit (or the fixed choice), residual out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from flayer.update import TensorDelta, Update
from protocol import UpdateOptions
from protocol.upload_cap import UploadCap, codec_ladder

from .residual import as_decoded, left_out, with_residual

__all__ = ["Fit", "fit_upload", "prepare_upload", "rate_estimate", "top_share", "upload_budget"]

log = logging.getLogger(__name__)
SAFETY = 0.8  # share of the estimated capacity an upload may plan on (rate noise, chunk overheads)
MARGIN_S = 1.0  # seconds kept for the coordinator's ack and clock skew
MIN_MEASURED_BYTES = 16 * 1024  # smaller publishes say more about latency than about the rate


@dataclass(frozen=True)
class Fit:
    codec: str
    keep: float  # share of the masked coordinates sent (1.0: all)
    size: int  # bytes of the encoded update
    budget: int  # bytes that fit the time left (0: no budget known, nothing fitted)

    @property
    def fits(self) -> bool:
        return self.budget == 0 or self.size <= self.budget


def rate_estimate(previous: float | None, nbytes: int, seconds: float, weight: float = 0.5) -> float | None:
    """The uplink rate (bytes/s) after an acknowledged upload of ``nbytes`` in ``seconds``: an
    exponential average with ``weight`` on the new measurement; small uploads are ignored."""
    if nbytes < MIN_MEASURED_BYTES or not seconds > 0 or not math.isfinite(seconds):
        return previous
    rate = nbytes / seconds
    return rate if previous is None else (1 - weight) * previous + weight * rate


def upload_budget(rate: float | None, seconds_left: float) -> int:
    """Bytes an upload may take: 0 when the rate is unknown (no fitting), at least 1 otherwise."""
    if rate is None or not rate > 0:
        return 0
    return max(1, int(rate * max(0.0, seconds_left - MARGIN_S) * SAFETY))


def top_share(update: Update, keep: float) -> Update:
    """The largest-magnitude ``keep`` share of each tensor's sent coordinates (at least one per tensor)."""
    if keep >= 1.0:
        return update
    deltas = {}
    for name, d in update.deltas.items():
        k = max(1, math.ceil(keep * d.count))
        if k >= d.count:
            deltas[name] = d
            continue
        chosen = np.sort(np.argpartition(np.abs(d.values), d.count - k)[d.count - k:])
        positions = chosen if d.indices is None else d.indices[chosen]
        deltas[name] = TensorDelta(d.shape, d.values[chosen], positions.astype(np.int64))
    return Update(deltas, update.num_samples, update.info)


def fit_upload(update: Update, size_of: Callable[[Update, str], int], start: str, cap: UploadCap,
               budget: int) -> tuple[Update, Fit]:
    """The update to send and the choice made (see module docstring); ``size_of(update, codec)``
    gives the encoded size."""
    ladder = codec_ladder(start, cap.lowest)
    if budget <= 0:
        return update, Fit(start, 1.0, size_of(update, start), 0)
    size = 0
    for codec in ladder:
        size = size_of(update, codec)
        if size <= budget:
            return update, Fit(codec, 1.0, size, budget)
    codec, keep, sent = ladder[-1], 1.0, update
    for _ in range(8):  # shrink the share in proportion to the overshoot; a few steps land under the budget
        keep = max(cap.min_keep, keep * budget / size * 0.95)
        sent = top_share(update, keep)
        size = size_of(sent, codec)
        if size <= budget or keep <= cap.min_keep:
            break
    return sent, Fit(codec, keep, size, budget)


def prepare_upload(update: Update, *, codec: str, zstd: bool, cap: UploadCap | None, fit: bool,
                   budget: int, residual: Mapping[str, np.ndarray] | None,
                   size_of: Callable[[Update, str], int], keep: float = 1.0) -> tuple[
                       Update, UpdateOptions, Fit, dict[str, np.ndarray] | None]:
    """Residual in (when ``residual`` is not None: error feedback on), the fitted or fixed choice
    (``codec`` and the top-k share ``keep``), and the residual out: (update to encode, its options,
    the choice, the next residual or None)."""
    full = with_residual(update, residual) if residual is not None else update
    if fit and cap is not None:
        sent, choice = fit_upload(full, size_of, codec, cap, budget)
    else:
        sent, choice = top_share(full, keep), Fit(codec, keep, 0, 0)
    nxt = left_out(full, as_decoded(sent, choice.codec), residual) if residual is not None else None
    return sent, UpdateOptions(choice.codec, zstd=zstd), choice, nxt
