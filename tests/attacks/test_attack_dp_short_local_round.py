"""A broker operator (or coordinator host) that holds back uploads to overshoot ``target_epsilon``
(docs/explanation/privacy.md, "The accountant").

In local mode a round's sum carries only the noise shares that arrive: k of m uploads carry ``z sqrt(k / m)``.
The budget check before a round assumes the fewest uploads it may close with (``min_updates``); the operator,
who relays every upload, delays all but one past the deadline and its extension, so the round closes (rule 5 of
:mod:`coordinator.rounds`) with one. The guarantee: ``target_epsilon`` against readers of the models is never
overshot -- such a round publishes nothing of its sum. Before the defence it was folded and composed: one round
at z = 1, m = 10, after three honest rounds, took epsilon to 21.2 past a target of 15.
"""

from __future__ import annotations

from coordinator.privacy import FederationPrivacy
from coordinator.rounds import RoundTimer
from flayer.engine.gate import Verdict
from flayer.engine.round import OpenAggregate
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

import numpy as np
import torch

M, MIN_UPDATES, TARGET = 10, 5, 15.0


def test_a_local_round_held_to_one_upload_does_not_pass_the_target() -> None:
    s = PrivacySettings(enabled=True, mode="local", clip=1.0, noise_multiplier=1.0, population=1000,
                        target_epsilon=TARGET)
    fp, _ = FederationPrivacy.of(s, _Strategy(), quorum=M, buffer=M, asynchronous=False, fewest=MIN_UPDATES)
    assert fp is not None
    g = {"w": torch.zeros(8)}
    published = 0
    for r in range(1, 40):
        if fp.over_budget(r, M) is not None:
            break
        arrived = M if r <= 3 else 1  # three honest rounds, then the operator lets one upload through
        timer = RoundTimer(0.0, 100.0, M, M, 5.0, MIN_UPDATES, 50.0)
        timer.accepted(arrived, 1.0)
        if arrived == 1:
            assert timer.decide(1, 101.0).action == "extend"
            timer.extend()
            assert timer.decide(1, 151.0).action == "close"  # closes with what arrived
        agg = OpenAggregate(None, g, fp.round(M))  # type: ignore[arg-type]
        up = Update({"w": TensorDelta((8,), np.full(8, 0.3, np.float32))}, 1, {})
        for _ in range(arrived):
            agg.fold(Verdict("accepted", update=up, norm=0.85, weight=1.0))
        if fp.withheld(agg) is not None:  # what the coordinator's close does
            agg.withhold()
        else:
            published += 1
        new = agg.result()
        fp.close(agg)
        assert fp.epsilon() <= TARGET, f"round {r}: epsilon {fp.epsilon():.3f} past target_epsilon {TARGET}"
        if agg.tally.accepted == 0:
            assert torch.equal(new["w"], g["w"]), "a withheld round moved the model"
    assert published == 3  # the honest rounds within the target still publish


class _Strategy:
    """What FederationPrivacy.of asks of a strategy (private rounds never fold through it)."""

    name = "fedavg"

    def needs_calibration(self) -> bool:
        return False

    def server_rule(self) -> str:
        return "carry"

    def options_dict(self) -> dict[str, object]:
        return {}
