"""The digest of a round plan's bound fields: what a secure round's transcript binds beside its protocol parameters.

A device's input to a secure round depends on more of the plan than its ``secure`` mapping: the model it starts
from (``model_digest``, the delta links to it), the strategy and its options, the model, the training settings,
the seed, the privacy terms. :func:`plan_digest` is SHA-256 over the canonical JSON of the whole plan minus an
explicit list of fields that legitimately change when the coordinator publishes the same round's plan again, so a
field added to :class:`protocol.messages.Plan` is bound by default. Every secure-round signature and sealed share
covers it (:attr:`flayer.secagg.SecAggParams.transcript`, through :func:`flayer.engine.secure_plan.plan_context`):
devices shown plans that differ in any bound field verify nothing of each other
(docs/explanation/secure-aggregation.md, "One plan for everyone").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .messages import Plan

__all__ = ["REPUBLISHED", "SECURE_REPUBLISHED", "plan_binding", "plan_digest"]

# Plan fields left out, each one a re-publication of the same round may change without changing any device's input:
#   deadline -- the round's end, moved when the round is extended (a timing, never an input);
#   close_by -- the expected close, recomputed from the fleet's measured durations on each publication;
#   issued   -- when this publication left the coordinator (later plans of one round are issued later).
REPUBLISHED = frozenset({"deadline", "close_by", "issued"})
# Keys of the plan's ``secure`` mapping left out:
#   void -- the sessions of earlier rounds abandoned before any consent was asked (booked by no device):
#           a statement about other rounds, which grows as they end; nothing of this round's input depends on it.
SECURE_REPUBLISHED = frozenset({"void"})
_DOMAIN = b"flayer-plan/v1/bound\x00"


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v


def plan_binding(plan: Plan) -> dict[str, Any]:
    """The plan's bound fields: every field of :class:`Plan` but :data:`REPUBLISHED`, its ``secure`` mapping
    without :data:`SECURE_REPUBLISHED`."""
    out = {f.name: _plain(getattr(plan, f.name)) for f in fields(Plan) if f.name not in REPUBLISHED}
    out["secure"] = {k: v for k, v in out["secure"].items() if k not in SECURE_REPUBLISHED}
    return out


def plan_digest(plan: Plan) -> bytes:
    """SHA-256 over the canonical JSON (sorted keys, no spaces) of :func:`plan_binding`: the same 32 bytes on the
    coordinator that wrote the plan and on every device that read it (JSON numbers decode to the values encoded)."""
    body = json.dumps(plan_binding(plan), separators=(",", ":"), sort_keys=True, allow_nan=False)
    return hashlib.sha256(_DOMAIN + body.encode("utf-8")).digest()
