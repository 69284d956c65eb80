"""One secure-aggregation round run in process: the four stages, every message through its bytes.

For the tests and the simulator. Each message is encoded with ``to_bytes`` and decoded with
:func:`~flayer.secagg.messages.decode_message` on the way, so the byte counts are those of the wire
layout and the codecs are exercised. A device may drop at one point of the round:

* ``"before_keys"``: it never advertises;
* ``"after_keys"``: it advertises and then sends nothing (no shares);
* ``"after_shares"``: it sends its shares and no masked input;
* ``"after_masked"``: it sends its masked input and gives no consent (with ``consistency``): it counts as
  dropped, its input left out of the sum; without the consistency round it does not answer the unmask stage;
* ``"after_consent"``: it sends its masked input and its consent, and does not answer the consistency or unmask
  stage (its input is in the sum, unmasked with its neighbours' shares).

With ``consistency`` (the default) each device whose masked input arrived is asked for its consent
(:mod:`~flayer.secagg.msg_consent`), and the survivors -- masked input and consent -- sign the survivor set
between the consents and the unmasking (:mod:`~flayer.secagg.consistency`), with in-process long-term keys
(:class:`LocalIdentities`).

A device that refuses a message (:class:`~flayer.secagg.errors.SecAggError`) drops at that point
and its reason is kept in ``RoundOutcome.refusals``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from .client import SecAggClient
from .consistency import LocalIdentities, ServerConsistency
from .errors import SecAggAbandoned, SecAggError
from .messages import Message, decode_message
from .params import SecAggParams
from .prg import Entropy, SeededEntropy
from .ring import decode_sum
from .server import SecAggServer

__all__ = ["DROP_POINTS", "RoundOutcome", "run_round"]

DropPoint = Literal["before_keys", "after_keys", "after_shares", "after_masked", "after_consent"]
DROP_POINTS: tuple[str, ...] = ("before_keys", "after_keys", "after_shares", "after_masked", "after_consent")
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class RoundOutcome:
    """What a round gave: the sums (None if abandoned), who survived or dropped, and each device's traffic.

    ``dropped`` are the devices that sent shares but are not survivors (no masked input, or no consent);
    ``bytes_per_device`` counts the bytes a device sent and received, ``messages_per_device`` the
    messages.
    """

    ring_sum: np.ndarray | None = field(repr=False)
    sum: np.ndarray | None = field(repr=False)
    survivors: frozenset[str]
    dropped: frozenset[str]
    abandoned_reason: str | None
    bytes_per_device: dict[str, int]
    messages_per_device: dict[str, int]
    refusals: dict[str, str]
    faulty: dict[str, str] = field(default_factory=dict)  # devices the coordinator named, with the proof


def _entropy_for(seed: bytes | None, device: str) -> Entropy:
    if seed is None:
        return os.urandom
    return SeededEntropy(hashlib.sha256(b"flayer-secagg/v1/local\x00" + seed + device.encode()).digest())


def run_round(params: SecAggParams, vectors: Mapping[str, np.ndarray],
              drop_after: Mapping[str, DropPoint] | None = None, seed: bytes | None = None,
              consistency: bool = True) -> RoundOutcome:
    """Run all four stages for ``params.participants``; ``vectors`` are ring-encoded (uint32) inputs.

    ``seed`` makes the run reproducible (every device's entropy is derived from it); without it the
    devices draw from ``os.urandom``.
    """
    drops = dict(drop_after or {})
    for device, point in drops.items():
        if not params.is_participant(device):
            raise ValueError(f"drop_after names {device!r}, not a participant")
        if point not in DROP_POINTS:
            raise ValueError(f"drop_after[{device!r}] must be one of {DROP_POINTS}, got {point!r}")
    for device in vectors:
        if not params.is_participant(device):
            raise ValueError(f"vectors names {device!r}, not a participant")
    missing = [d for d in params.participants if drops.get(d) not in DROP_POINTS[:3] and d not in vectors]
    if missing:
        raise ValueError(f"no vector for {missing}, which send a masked input")

    nbytes = dict.fromkeys(params.participants, 0)
    nmsgs = dict.fromkeys(params.participants, 0)
    refusals: dict[str, str] = {}

    def carry(msg: M, device: str) -> M:
        raw = msg.to_bytes()
        nbytes[device] += len(raw)
        nmsgs[device] += 1
        out = decode_message(raw)
        assert type(out) is type(msg)
        return out

    ids = LocalIdentities(params.participants, _entropy_for(seed, "identities/")) if consistency else None
    server = SecAggServer(params, ServerConsistency(ids.verify) if ids else None)
    clients = {d: SecAggClient(params, d, _entropy_for(seed, d), ids.for_device(d) if ids else None)
               for d in params.participants}
    alive = [d for d in params.participants if drops.get(d) != "before_keys"]

    def step(leaving: str | None, action: str) -> None:
        nonlocal alive
        still = []
        for d in alive:
            try:
                if action == "advertise":
                    server.receive_advert(carry(clients[d].advertise(), d))
                elif action == "share":
                    bundle = carry(server.key_bundle(d), d)
                    server.receive_shares(carry(clients[d].share_keys(bundle), d))
                elif action == "mask":
                    shares = carry(server.shares_for(d), d)
                    masked = clients[d].masked_input(shares, vectors[d])
                    for complaint in clients[d].complaints():  # before the masked input, as a device sends them
                        server.receive_complaint(carry(complaint, d))
                    server.receive_masked(carry(masked, d))
                elif action == "consent":
                    asked = carry(server.consent_request(d), d)
                    server.receive_consent(carry(clients[d].consent(asked), d))
                elif action == "sign":
                    shown = carry(server.consistency_request(d), d)
                    server.receive_signature(carry(clients[d].sign_survivors(shown), d))
                else:
                    request = carry(server.unmask_request(d), d)
                    server.receive_unmask(carry(clients[d].unmask(request), d))
            except SecAggError as exc:
                refusals[d] = str(exc)
                continue
            if drops.get(d) != leaving:
                still.append(d)
        alive = still

    try:
        step("after_keys", "advertise")
        step("after_shares", "share")
        step("", "mask")  # "": nobody leaves here
        alive = [d for d in alive if drops.get(d) != "after_masked"]  # gone after the masked input: no consent
        if consistency:
            step("after_consent", "consent")
            step("", "sign")
        else:  # no consent stage: leaving after the consent is leaving after the masked input
            alive = [d for d in alive if drops.get(d) != "after_consent"]
        step(None, "unmask")
        ring_sum = server.result()
    except SecAggAbandoned as exc:
        return RoundOutcome(None, None, server.survivors, server.dropped, exc.reason, nbytes, nmsgs, refusals,
                            dict(server.faulty))
    try:  # a device that masked values outside the ring's range shows here (or not at all: the sum is all we see)
        total = decode_sum(ring_sum, params.ring, len(server.survivors))
    except ValueError as exc:
        return RoundOutcome(ring_sum, None, server.survivors, server.dropped, f"the unmasked sum is out of range: {exc}",
                            nbytes, nmsgs, refusals, dict(server.faulty))
    return RoundOutcome(ring_sum, total, server.survivors, server.dropped, None, nbytes, nmsgs, refusals,
                        dict(server.faulty))
