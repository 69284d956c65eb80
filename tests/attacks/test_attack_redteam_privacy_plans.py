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
- adaptive clipping in local mode (the clip bit would reach the coordinator outside any sum and un-noised).

(A secure round whose noise share is too small is ``tests/attacks/test_attack_redteam_secagg_noise.py``.)
The guarantee: the device refuses the round (it skips it), or what it sends carries at least half the noise it
counts. Run against the device's own code: :func:`edge_client.work.train_and_encode`, what every upload goes
through.
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
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import Plan, WireLimits, decode_update

C, Z, M = 0.05, 1.0, 4
SELECTED = ("dev-1", "dev-2", "dev-3", "dev-4")  # M devices: a synchronous m is at most the selection


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


def _send(setup: Any, privacy: dict[str, Any]) -> Any:
    """The upload the device sends for the plan, decoded as the coordinator does (None: it refused the round)."""
    shard, strategy, g, base = setup
    plan = Plan(**{**base, "privacy": privacy})
    try:
        up = train_and_encode(strategy, plan, g, strategy.initial_state(), shard,
                              round_context(plan, 1, torch.device("cpu")), federation="fed", sender="dev-1",
                              max_payload=1 << 20, max_update_bytes=0, amp=False)
    except SkipRound:
        return None
    return decode_update(up.blob, WireLimits()).update


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
