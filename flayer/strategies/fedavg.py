"""FedAvg (McMahan et al., 2017): train the global model locally, upload every tensor, average."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..train import ClientData, sgd_epochs
from ..update import delta_update, float_state
from .base import ClientState, LocalResult, RoundContext, Strategy


class FedAvg(Strategy):
    name = "fedavg"

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        opt = torch.optim.SGD(model.parameters(), lr=self.train.lr)
        loss = sgd_epochs(model, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator())
        local = float_state(model)
        update = delta_update(local, global_state, {k: None for k in local}, data.num_train)
        return LocalResult(update, state, {"train_loss": loss})
