"""What the coordinator does with one complete update blob, as pure functions: accept, or say why not.

:func:`screen` decides from the (client, round) pair alone -- before anything is decoded -- and
:func:`validate` decodes and checks the blob against the open round. Every outcome is a
:class:`Verdict` carrying the ack status, a one-line reason and, for anything not accepted, the
name of the counter it increments (kept in metrics.jsonl and in the final summary):

==============  ============  ===========================================================
counter         ack status    when
==============  ============  ===========================================================
future_round    rejected      the update names a round that is not open yet
late            late          the update is for a round already closed
not_selected    not_selected  the device is not in this round's plan
duplicate       duplicate     this device's update for this round was already folded
oversize        rejected      the blob exceeds ``max_update_bytes``, or its declared size (the
                              envelope's total, a zstd payload's length) exceeds what the
                              round's model can hold (protocol.payload_bound)
malformed       rejected      the blob does not decode (protocol.WireError), or its header
                              names another federation or round
wrong_sender    rejected      the blob's sender is not the device whose topic carried it
wrong_model     rejected      the deltas are against another global model (base digest)
invalid         rejected      shapes, positions, sample count (flayer.aggregate.check_update)
norm            rejected      the L2 norm exceeds the round's bound (``norm_bound``, or the
                              automatic one of :mod:`coordinator.guard`; policy ``reject``)
==============  ============  ===========================================================

The checks run cheapest first: the header (sender, round, model digest) and the declared sizes
are read without decompressing anything (:func:`protocol.read_update_head`); only then is the
payload decoded, its decompression capped by the model's dense size. An accepted update's
aggregation weight is ``min(num_samples, max_samples)`` (counter ``weight_capped`` when cut).
With policy ``clip`` an update over the bound is scaled down to it and accepted (counter
``clipped``). Chunk-level problems (bad envelope, CRC, wrong topic, a reassembled blob that does
not match its digest) are counted by the inbox as ``bad_chunk``; an unfinished blob it drops as
``incomplete`` (its round closed with chunks missing, a contradicting chunk made it start over,
or its sender started more than a few others); malformed status or metrics messages as
``bad_message``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import AbstractSet

import numpy as np

from flayer.aggregate import UpdateError, check_update
from flayer.update import TensorDelta, Update
from protocol import WireError, WireLimits, decode_update, read_update_head

__all__ = ["REJECTION_COUNTERS", "IntakeContext", "Verdict", "clip_update", "screen", "validate"]

REJECTION_COUNTERS = ("future_round", "late", "not_selected", "duplicate", "oversize", "malformed", "wrong_sender",
                      "wrong_model", "invalid", "norm", "bad_chunk", "incomplete", "bad_message", "cut_off",
                      "queue_full", "retained", "quarantined")
# refusals that count against a device's budget of max_malformed per round
STRIKES = frozenset({"oversize", "malformed", "wrong_sender", "wrong_model", "invalid", "norm", "bad_chunk"})
HEAD_SLACK = 8192  # an update blob's header and info entries, at most (protocol.update_codec)


@dataclass(frozen=True)
class Verdict:
    status: str  # accepted | duplicate | rejected | late | not_selected
    reason: str = ""
    counter: str | None = None
    update: Update | None = None
    norm: float = 0.0
    clipped: bool = False
    weight: float = 0.0  # the aggregation weight (num_samples, capped at max_samples)

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


def _no(status: str, counter: str, reason: str) -> Verdict:
    return Verdict(status, reason[:500], counter)


@dataclass(frozen=True)
class IntakeContext:
    """The open round, as the validator needs it."""

    federation: str
    round: int
    base_digest: str
    shapes: Mapping[str, tuple[int, ...]]
    limits: WireLimits
    max_update_bytes: int
    norm_bound: float | None = None
    norm_policy: str = "reject"
    selected: AbstractSet[str] = field(default_factory=frozenset)
    max_samples: int = 2**32
    payload_cap: int = 2**32  # protocol.payload_bound(shapes): the largest payload the model can hold

    @property
    def blob_cap(self) -> int:
        """The largest update blob an honest device sends for this model."""
        return min(self.max_update_bytes, self.payload_cap + HEAD_SLACK)


def screen(client: str, round_: int, open_round: int | None, done_round: int, selected: AbstractSet[str],
           accepted: AbstractSet[str], accepted_before: Mapping[int, AbstractSet[str]]) -> Verdict | None:
    """A verdict from the (client, round) pair alone, or None when the blob must be validated.
    ``open_round``: the round taking updates (None between rounds); ``done_round``: the last closed one."""
    if round_ <= done_round:
        if client in accepted_before.get(round_, ()):
            return _no("duplicate", "duplicate", f"the update of {client} for round {round_} was already folded")
        return _no("late", "late", f"round {round_} is closed; the open round is {open_round or 'none yet'}")
    if open_round is None or round_ != open_round:
        return _no("rejected", "future_round", f"round {round_} is not open (open round: {open_round or 'none'})")
    if client not in selected:
        return _no("not_selected", "not_selected", f"{client} is not selected for round {round_}")
    if client in accepted:
        return _no("duplicate", "duplicate", f"the update of {client} for round {round_} was already folded")
    return None


def clip_update(update: Update, factor: float) -> Update:
    """``update`` with every delta multiplied by ``factor`` (< 1: clipping to a norm bound)."""
    deltas = {k: TensorDelta(d.shape, (d.values * np.float32(factor)).astype(np.float32), d.indices)
              for k, d in update.deltas.items()}
    return Update(deltas, update.num_samples, update.info)


def validate(client: str, blob: bytes, ctx: IntakeContext) -> Verdict:
    """Decode ``blob`` and check it against the open round (see module docstring)."""
    if len(blob) > ctx.blob_cap:
        return _no("rejected", "oversize", f"update of {len(blob)} bytes exceeds {ctx.blob_cap} (max_update_bytes "
                                           f"{ctx.max_update_bytes}, or what the model holds)")
    try:
        head = read_update_head(blob, ctx.limits)
    except WireError as exc:
        return _no("rejected", "malformed", exc.reason)
    h = head.header
    if h.federation != ctx.federation or h.round != ctx.round:
        return _no("rejected", "malformed", f"update header names federation {h.federation!r} round {h.round}, "
                                            f"expected {ctx.federation!r} round {ctx.round}")
    if h.sender != client:
        return _no("rejected", "wrong_sender", f"update header names sender {h.sender!r}, sent by {client!r}")
    if h.base_digest != ctx.base_digest:
        return _no("rejected", "wrong_model", f"update is against model {h.base_digest[:12]}, round {ctx.round} "
                                              f"uses {ctx.base_digest[:12]}")
    if head.payload_bytes > ctx.payload_cap:
        return _no("rejected", "oversize", f"update declares a payload of {head.payload_bytes} bytes, the model "
                                           f"holds at most {ctx.payload_cap}")
    try:
        dec = decode_update(blob, ctx.limits, ctx.shapes)
    except WireError as exc:
        return _no("rejected", "malformed", exc.reason)
    try:
        norm = check_update(dec.update, ctx.shapes, None)
    except UpdateError as exc:
        return _no("rejected", "invalid", str(exc))
    update = dec.update
    weight = float(min(update.num_samples, ctx.max_samples))
    if ctx.norm_bound is not None and norm > ctx.norm_bound:
        if ctx.norm_policy != "clip":
            return _no("rejected", "norm", f"update norm {norm:.4g} exceeds the bound {ctx.norm_bound:.4g}")
        update = clip_update(update, ctx.norm_bound / norm * (1 - 1e-6))
        return Verdict("accepted", f"clipped from norm {norm:.4g} to {ctx.norm_bound:.4g}", None, update, norm, True,
                       weight)
    return Verdict("accepted", "", None, update, norm, False, weight)
