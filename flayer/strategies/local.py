"""Local training only: no federation. Each client trains its own model from the common
initialisation and uploads nothing; the server's model never changes.

Download: the client's own model (the common initial model in its first round); nothing is
overwritten. Upload: no tensors (an empty update, so the round's bookkeeping stays uniform).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..models import ModelSpec
from ..train import ClientData, sgd_epochs
from ..update import Update
from .base import ClientState, LocalResult, RoundContext, Strategy
from .partial import float_names, mixed_state, personal_state


class Local(Strategy):
    name = "local"

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        self.names = float_names(self)

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        return self.model_from(mixed_state(global_state, state, self.names), ctx.device)

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        opt = torch.optim.SGD(model.parameters(), lr=self.train.lr)
        loss = sgd_epochs(model, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator())
        return LocalResult(Update({}, data.num_train), personal_state(model, self.names, state),
                           {"train_loss": loss})
