"""A device survives a bad global model: a non-finite model, loss or update makes it skip the round
with a reason (edge_client.work.SkipRound), it never exits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.work import SkipRound, check_finite_round, train_and_encode
from flayer.config import TrainConfig
from flayer.partition import make_partition
from flayer.engine import initial_global_state
from flayer.strategies import make_strategy
from flayer.strategies.base import LocalResult, RoundContext
from flayer.train import client_data
from flayer.update import TensorDelta, Update
from protocol import Plan


def _plan(round_: int = 3) -> Plan:
    return Plan(round=round_, selected=("dev-1",), deadline=0.0, strategy="flayer", options={}, model={},
                model_digest="ab" * 32, model_chunks=1, model_size=1)


def _result(values: list[float], loss: float = 0.5) -> LocalResult:
    up = Update({"w": TensorDelta((2,), np.asarray(values, dtype=np.float32))}, 10)
    return LocalResult(up, {}, {"train_loss": loss})


def test_each_non_finite_part_is_a_skip_with_its_reason() -> None:
    plan = _plan()
    check_finite_round(plan, {"w": torch.zeros(2)}, _result([0.1, 0.2]))  # all finite: no skip
    with pytest.raises(SkipRound, match="global model of round 3 is not finite .*'w'"):
        check_finite_round(plan, {"w": torch.tensor([1.0, float("nan")])})
    with pytest.raises(SkipRound, match="training loss is nan"):
        check_finite_round(plan, None, _result([0.1, 0.2], loss=float("nan")))
    with pytest.raises(SkipRound, match="update of tensor 'w' is not finite"):
        check_finite_round(plan, None, _result([0.1, float("inf")]))


def test_a_huge_finite_global_model_is_skipped_not_fatal(digits) -> None:  # type: ignore[no-untyped-def]
    """The reported attack: a finite global model of 3e38 everywhere. Training on it gives NaN
    gradient norms (flayer's Eq. 4 no longer raises on them) and a non-finite loss: SkipRound."""
    strategy = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10), {})
    data = client_data(digits, make_partition(digits.y, digits.num_classes, 4, "iid", 0).clients[0])
    g = {k: torch.full_like(v, 3e38) for k, v in initial_global_state(strategy, 0).items()}
    ctx = RoundContext(round=3, client=0, seed=0, device=torch.device("cpu"))
    with pytest.raises(SkipRound, match="round 3"):
        train_and_encode(strategy, _plan(), g, strategy.initial_state(), data, ctx, federation="f", sender="dev-1",
                         max_payload=1 << 20, max_update_bytes=0, amp=False)
