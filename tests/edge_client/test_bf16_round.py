"""A local round under the edge client's bf16 autocast region learns as the fp32 round does. Run on the CPU's
bf16 autocast (the CUDA region is the same call with "cuda"; tests/integration/test_federation_cuda.py runs it on
a GPU): with autocast's weight-cast cache on, every forward pass of the round read the weights from before the
first step and the round trained nothing (train loss 2.25 against 1.07 in fp32 on this shard)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from edge_client.work import bf16_region
from flayer.config import TrainConfig
from flayer.engine.client_step import client_round
from flayer.engine.round import initial_global_state
from flayer.partition import make_partition
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.train import client_data


def test_a_bf16_local_round_trains_like_fp32(digits: Any) -> None:
    part = make_partition(digits.y, digits.num_classes, 5, "dir0.5", seed=0,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    data = client_data(digits, part.clients[0])
    strategy = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10, local_epochs=1), {})
    global_state = initial_global_state(strategy, 0)
    ctx = RoundContext(1, 0, 0, torch.device("cpu"))
    losses = {}
    for name, region in (("fp32", contextlib.nullcontext()), ("bf16", bf16_region("cpu"))):
        with region:
            _, result = client_round(strategy, global_state, strategy.initial_state(), data, ctx)
        assert result is not None
        losses[name] = result.metrics["train_loss"]
    assert losses["fp32"] < 1.5, losses  # the shard is learnable in one epoch
    assert abs(losses["bf16"] - losses["fp32"]) < 0.1, f"the bf16 round did not train as fp32 does: {losses}"
