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
stale           late          (async) trained from a version more than ``max_staleness`` behind
not_selected    not_selected  the device is not in this round's plan
duplicate       duplicate     this device's update for this round was already folded
in_buffer       late          (async) this device already has an update in this version's buffer
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

The checks run cheapest first: the (client, round) pair (:func:`screen`) and the declared size
(the inbox, from the first chunk's envelope: ``blob_cap``), then the header (sender, round, model
digest) and the payload's declared size, read without decompressing anything
(:func:`protocol.read_update_head`); only then is the payload decoded -- its decompression capped
by the model's dense size -- through the one validity gate, and the admission policy of
:mod:`flayer.engine.gate` applies the norm bound (``reject``, or ``clip``: counter ``clipped``),
the weight cap ``min(num_samples, max_samples)`` (counter ``weight_capped``) and, in asynchronous
rounds, the staleness weight. Chunk-level problems (bad envelope, CRC, wrong topic, a reassembled blob that does
not match its digest) are counted by the inbox as ``bad_chunk``; an unfinished blob it drops as
``incomplete`` (its round closed with chunks missing, a contradicting chunk made it start over,
its sender started more than a few others or went over its share of ``max_pending_bytes``);
malformed status or metrics messages as ``bad_message``. Which refusals count towards a device's
cut-off (``max_malformed``) is :data:`STRIKES`; the rule is in :mod:`coordinator.inbox`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import AbstractSet

from flayer.engine import Bounds, Verdict, VersionWindow, admit, refuse
from flayer.engine import screen as screen_base
from protocol import InvalidUpdate, WireError, WireLimits, decode_update, read_update_head

__all__ = ["REJECTION_COUNTERS", "IntakeContext", "Verdict", "screen", "validate"]

REJECTION_COUNTERS = ("future_round", "late", "stale", "in_buffer", "not_selected", "duplicate", "oversize", "malformed",
                      "wrong_sender", "wrong_model", "invalid", "norm", "bad_chunk", "incomplete", "bad_message",
                      "cut_off", "queue_full", "retained", "quarantined", "secure", "unsigned",
                      "replayed")
# refusals that count against a device's budget of max_malformed per round: junk no honest device sends
# (coordinator.inbox; secure: a secure-round protocol message refused); late, stale, not_selected and duplicate are what honest devices send, and never count
STRIKES = frozenset({"future_round", "oversize", "malformed", "wrong_sender", "wrong_model", "invalid", "norm",
                     "bad_chunk", "secure"})
LATE_MASKED = "late: "  # coordinator.secure_round: a masked input after the survivors were named (no strike)
HEAD_SLACK = 8192  # an update blob's header and info entries, at most (protocol.update_codec)


@dataclass(frozen=True)
class IntakeContext:
    """The open round (or asynchronous buffer), as the validator needs it. ``bases``: the model digest of
    every version an update may be trained from (synchronous: the open round's only)."""

    federation: str
    round: int
    bases: Mapping[int, str]
    shapes: Mapping[str, tuple[int, ...]]
    limits: WireLimits
    max_update_bytes: int
    bounds: Bounds = field(default_factory=Bounds)
    payload_cap: int = 2**32  # protocol.payload_bound(shapes): the largest payload the model can hold
    # a secure round: the update blob is the device's masked input, taken by its protocol (the reason it is
    # refused, or None: coordinator.secure_round.SecureRound.masked); nothing is decoded here
    masked: Callable[[str, bytes], str | None] | None = None

    @property
    def blob_cap(self) -> int:
        """The largest update blob an honest device sends for this model."""
        return min(self.max_update_bytes, self.payload_cap + HEAD_SLACK)


def screen(client: str, round_: int, open_round: int | None, done_round: int, selected: AbstractSet[str],
           accepted: AbstractSet[str], accepted_before: Mapping[int, AbstractSet[str]],
           window: VersionWindow | None = None) -> Verdict | None:
    """A verdict from the (client, round) pair alone, or None when the blob must be validated.
    ``open_round``: the round taking updates (None between rounds); ``done_round``: the last closed one;
    ``window``: an asynchronous federation's versions (then the other arguments are not used)."""
    if window is not None:
        return window.screen(client, round_)
    offered = {open_round: selected} if open_round is not None else {}
    folded = {**accepted_before, **({open_round: accepted} if open_round is not None else {})}
    return screen_base(client, round_, open_round, done_round, offered, folded)


def validate(client: str, blob: bytes, ctx: IntakeContext, round_: int | None = None) -> Verdict:
    """Decode ``blob`` and check it against the open round (see module docstring). ``round_``: the round
    the update's topic named (default: the open round); the header must name the same one, a version
    ``ctx.bases`` holds, and its staleness is counted from it."""
    expected = ctx.round if round_ is None else round_
    if ctx.masked is not None:
        if expected != ctx.round:
            return refuse("rejected", "malformed", f"a masked input of round {expected} in secure round {ctx.round}")
        why = ctx.masked(client, blob)
        if why is not None and why.startswith(LATE_MASKED):  # the unmasking began: late, as a slow honest device is
            return refuse("late", "late", why)
        return refuse("rejected", "secure", why) if why is not None else Verdict("accepted")
    try:
        head = read_update_head(blob, ctx.limits)
    except WireError as exc:
        return refuse("rejected", "malformed", exc.reason)
    h = head.header
    if h.federation != ctx.federation or h.round != expected or h.round not in ctx.bases:
        return refuse("rejected", "malformed", f"update header names federation {h.federation!r} round {h.round}, "
                                               f"expected {ctx.federation!r} round {expected}")
    if h.sender != client:
        return refuse("rejected", "wrong_sender", f"update header names sender {h.sender!r}, sent by {client!r}")
    if h.base_digest != ctx.bases[h.round]:
        return refuse("rejected", "wrong_model", f"update is against model {h.base_digest[:12]}, round {h.round} "
                                                 f"uses {ctx.bases[h.round][:12]}")
    if head.payload_bytes > ctx.payload_cap:
        return refuse("rejected", "oversize", f"update declares a payload of {head.payload_bytes} bytes, the model "
                                              f"holds at most {ctx.payload_cap}")
    try:
        dec = decode_update(blob, ctx.limits, ctx.shapes)  # the validity gate: shapes, positions, finite, norm
    except InvalidUpdate as exc:
        return refuse("rejected", "invalid", exc.reason)
    except WireError as exc:
        return refuse("rejected", "malformed", exc.reason)
    assert dec.norm is not None
    return admit(dec.update, dec.norm, ctx.bounds, ctx.round - h.round)
