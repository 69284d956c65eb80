"""A coordinator that writes the privacy parameters of its plans to strip the devices' noise
(docs/explanation/privacy.md, "A device's own budget" and "Who learns what").

In local mode the coordinator is an adversary: the guarantee against it rests on the noise each device adds
itself, and the device counts its own epsilon from the plan's parameters. The adversary holds the coordinator's
signing key, so it writes any plan it likes; it reads what a device sends back (its upload, or in a secure round
the ring vector its masked input hides, which the coordinator learns summed with the others' once the round is
unmasked). Each case below is a plan an honest coordinator never writes, whose literal reading would have the
device send its clipped update with less noise than the multiplier it counts
(:func:`edge_client.budget.contribution_multiplier`), or a data-dependent bit in the clear:

- ``ring`` set without a secure round (the shares are meant to be drawn inside a secure sum; there is none);
- adaptive clipping in local mode (the clip bit would reach the coordinator outside any sum and un-noised);
- a secure local-mode round whose ``noise_std`` is below the share the threshold needs, or zero.

The guarantee: the device refuses the round (it skips it), or what it sends carries at least half the noise it
counts. Run against the device's own code: :func:`edge_client.work.train_and_encode` (what every upload goes
through) and the device's parsing of the plan's secure round (:func:`flayer.engine.secure.secure_from_plan`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.publish import model_blob
from edge_client.budget import contribution_multiplier
from edge_client.work import SkipRound, StrategyCache, round_context, train_and_encode
from flayer.engine import initial_global_state
from flayer.engine.privacy import RoundPrivacy, clip_upload
from flayer.engine.secure import plan_round, plan_secure, secure_from_plan
from flayer.engine.secure_layout import flatten, layout_of, round_layout
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings
from flayer.secagg.ring import decode_sum
from flayer.train import client_data
from protocol import Plan, WireLimits, decode_update

C, Z, M = 0.05, 1.0, 4
SELECTED = ("dev-0", "dev-1", "dev-2", "dev-3")


@pytest.fixture(scope="module")
def setup(digits: Any) -> Any:
    shard = client_data(digits, make_partition(digits.y, digits.num_classes, 4, "iid", 0).clients[1])
    spec = dataclasses.asdict(digits.model_spec())
    base = {"round": 2, "selected": SELECTED, "deadline": 1e9, "strategy": "fedavg", "options": {}, "model": spec,
            "model_digest": "ab" * 32, "model_chunks": 1, "model_size": 1, "seed": 3,
            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))  # type: ignore[arg-type]
    g = initial_global_state(strategy, 3)
    return shard, strategy, g, {**base, "model_digest": model_blob(g).digest}


def _send(setup: Any, privacy: dict[str, Any], secure: dict[str, Any] | None = None) -> Any:
    """What the device sends for the plan (None: it refused the round): its decoded upload, or its ring vector."""
    shard, strategy, g, base = setup
    plan = Plan(**{**base, "privacy": privacy, "secure": secure or {}})
    planned = None
    if secure:
        try:
            planned = secure_from_plan(plan.secure, plan.round, tuple(plan.selected))
        except ValueError:
            return None
    try:
        up = train_and_encode(strategy, plan, g, strategy.initial_state(), shard,
                              round_context(plan, 1, torch.device("cpu")), federation="fed", sender="dev-1",
                              max_payload=1 << 20, max_update_bytes=0, amp=False, secure=bool(secure))
    except SkipRound:
        return None
    if planned is None:
        return decode_update(up.blob, WireLimits()).update
    layout = layout_of(up.update)
    return up.update, planned, layout, planned.vector(up.update, layout)


def _counted(privacy: dict[str, Any], secure: bool) -> float:
    rp = RoundPrivacy.from_plan(privacy)
    assert rp is not None
    return contribution_multiplier(rp, secure)


def _norm(update: Any) -> tuple[float, int]:
    values = np.concatenate([d.values.astype(np.float64) for d in update.deltas.values()])
    return float(np.linalg.norm(values)), values.size


def test_the_honest_local_plan_is_noised_as_counted(setup: Any) -> None:
    honest = RoundPrivacy("local", C, Z, Z, M).as_plan()
    up = _send(setup, honest)
    norm, d = _norm(up)
    assert norm >= 0.5 * _counted(honest, False) * C * math.sqrt(d)  # the check below can pass


def test_a_ring_plan_without_a_secure_round_does_not_strip_the_noise(setup: Any) -> None:
    hostile = RoundPrivacy("local", C, Z, Z, M, ring=True).as_plan()
    up = _send(setup, hostile)
    if up is None:
        return
    norm, d = _norm(up)
    counted = _counted(hostile, False) * C * math.sqrt(d)
    assert norm >= 0.5 * counted, (f"the coordinator received an upload of norm {norm:.4g} (clip {C}): no noise, "
                                   f"while the device counts noise of norm about {counted:.4g}")


def test_adaptive_clipping_in_local_mode_does_not_send_the_clip_bit(setup: Any) -> None:
    hostile = RoundPrivacy("local", C, Z, Z, M, adaptive=True, bit_std=0.2).as_plan()
    up = _send(setup, hostile)
    assert up is None or "dp_unclipped" not in up.info, \
        "the coordinator received the clip bit (whether the update was within C) in the clear in local mode"


def _secure_plan(setup: Any, rp: RoundPrivacy, **tamper: Any) -> dict[str, Any]:
    """An honest coordinator's secure-round plan (coordinator.secure_phase), then the adversary's edits."""
    _, strategy, g, base = setup
    s = PrivacySettings(enabled=True, mode="local", clip=C, noise_multiplier=Z, population=8,
                        expected_contributions=M, secure_aggregation=True)
    layout = round_layout(strategy, g, base["round"], base["seed"])
    planned = plan_round(s, "fed.2.x", base["round"], SELECTED, layout, base["seed"], rp, None)
    return {**plan_secure(planned), **tamper}


@pytest.mark.parametrize("case", ["honest", "no noise", "a tenth"])
def test_a_secure_local_round_carries_the_noise_the_device_counts(setup: Any, case: str) -> None:
    ring = RoundPrivacy("local", C, Z, Z, M, ring=True)
    secure = _secure_plan(setup, ring)
    privacy = ring.as_plan()
    if case == "no noise":
        secure["noise_std"] = 0.0
    elif case == "a tenth":
        secure["noise_std"] = secure["noise_std"] / 10
    out = _send(setup, privacy, secure)
    if out is None:
        assert case != "honest", "the device refused an honest secure round"
        return
    _, planned, layout, vector = out
    reference = _send(setup, RoundPrivacy("central", C, Z, Z, M).as_plan())  # the same round, clipped, no noise
    clipped = flatten(clip_upload(reference, C)[0], layout)
    seen = decode_sum(vector, planned.params.ring, 1)[:layout.n]  # what unmasking reveals of this device's term
    noise = float(np.std(seen - clipped))
    # the device counts multiplier z against the coordinator: the threshold's t survivors' shares carry z C
    need = _counted(privacy, True) * C / math.sqrt(planned.params.threshold)
    assert noise >= 0.5 * need, (f"{case}: the device's term of the unmasked sum carries noise of std {noise:.3g}; "
                                 f"it counts multiplier {_counted(privacy, True):g}, a share of std {need:.3g}")
