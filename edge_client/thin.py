"""A device's thin-link uploads: its uplink rate, its residual, and the per-round upload choice.

:class:`ThinUploads` holds what the edge client needs from :mod:`edge_client.linkfit` and
:mod:`edge_client.residual` across rounds and reboots: the uplink rate (``[edge] uplink_kbps``, or
the estimate from its acknowledged uploads, kept in ``<state_dir>/uplink.json``) and the residual
files. :meth:`ThinUploads.prepare_for` gives the step :func:`edge_client.work.train_and_encode`
runs between training and encoding (the budget also stays within the plan's and the device's
``max_update_bytes``); :meth:`ThinUploads.measured` takes each acknowledged publish.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from flayer.state import atomic_write
from flayer.update import Update
from protocol import Plan, UpdateHeader, UpdateOptions, WireError, encode_update
from protocol.upload_cap import upload_cap

from .config import EdgeSettings
from .linkfit import Fit, prepare_upload, rate_estimate, upload_budget
from .residual import ResidualStore

__all__ = ["ThinUploads"]

log = logging.getLogger(__name__)


def time_left(plan: Plan, now: float) -> float:
    """Seconds until the update should have arrived: the plan's expected close (``close_by``, from the
    coordinator's recent rounds) when it gives one, else its deadline."""
    if plan.close_by > 0:
        return (plan.close_by if plan.mode == "async" else min(plan.deadline, plan.close_by)) - now
    return plan.deadline - now


class ThinUploads:
    def __init__(self, settings: EdgeSettings, clock: Callable[[], float]) -> None:
        self.settings, self.clock = settings, clock
        self.residuals = ResidualStore(settings.state_dir)
        self.rate_file = Path(settings.state_dir) / "uplink.json"
        self.estimate: float | None = self._load_rate()
        self.last: Fit | None = None

    def _load_rate(self) -> float | None:
        try:
            rate = float(json.loads(self.rate_file.read_text())["bytes_per_s"])
            return rate if rate > 0 else None
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s (%s)", self.rate_file, exc)
            return None

    @property
    def rate(self) -> float | None:
        """Uplink bytes/s: the configured rate, else the estimate (None before any measurement)."""
        return self.settings.uplink_kbps * 1000 / 8 if self.settings.uplink_kbps > 0 else self.estimate

    def measured(self, nbytes: int, seconds: float) -> None:
        """An upload of ``nbytes`` was acknowledged (PUBACKs) ``seconds`` after its first publish."""
        new = rate_estimate(self.estimate, nbytes, seconds)
        if new is not None and new != self.estimate:
            self.estimate = new
            atomic_write(self.rate_file, json.dumps({"bytes_per_s": new}).encode())

    def prepare_for(self, plan: Plan, federation: str, sender: str) -> Callable[[Update], tuple[Update,
                                                                                           UpdateOptions]]:
        """The step between training and encoding for ``plan``'s round (error feedback, fitting)."""
        s = self.settings
        try:
            cap = upload_cap(plan.upload_fit)
        except WireError:  # the plan's own check refuses it first
            cap = None
        header = UpdateHeader(federation, plan.round, sender, plan.model_digest)

        def size_of(update: Update, codec: str) -> int:
            return len(encode_update(update, header, UpdateOptions(codec, zstd=plan.compress)))

        def prepare(update: Update) -> tuple[Update, UpdateOptions]:
            residual = self.residuals.before(plan.round) if s.error_feedback else None
            budget = upload_budget(self.rate, time_left(plan, self.clock())) if s.upload == "fit" else 0
            limits = [x for x in (budget, plan.max_update_bytes, s.max_update_bytes) if x > 0]
            budget = min(limits) if s.upload == "fit" and limits else 0  # and never over the size limits
            # a link not measured yet (no rate configured, no upload acknowledged): the lowest codec the plan
            # allows, so the first upload of a thin link is not the one sure to be late; fitted from the next on
            start = cap.lowest if s.upload == "fit" and self.rate is None and cap is not None else plan.value_codec
            sent, options, fit, nxt = prepare_upload(update, codec=start, zstd=plan.compress, cap=cap,
                                                     fit=s.upload == "fit", budget=budget, residual=residual,
                                                     size_of=size_of)
            if nxt is not None:
                self.residuals.save(plan.round, nxt)
            self.last = fit
            if s.upload == "fit":
                log.info("%s: round %d upload %s, %.0f%% of the masked coordinates, %d bytes for a budget of %d",
                         sender, plan.round, fit.codec, 100 * fit.keep, fit.size, fit.budget)
            return sent, options

        return prepare
