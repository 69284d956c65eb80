"""LG-FedAvg (Liang et al., 2020): local representations, a global head.

Download: head <- global, body <- the client's own body (the global one in its first round).
Local round: train every layer; upload the head only; keep the body (``personal.<body tensors>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..models import ModelSpec
from ..train import ClientData, sgd_epochs
from .base import ClientState, LocalResult, RoundContext, Strategy
from .partial import HeadOptions, float_names, mixed_state, personal_state, plan_for, upload


class LGFedAvg(Strategy):
    name = "lgfedavg"
    options_type = HeadOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        self.plan = plan_for(self, self.options.head_layers)
        self.head = self.plan.tensors(head=True)
        self.body = tuple(n for n in float_names(self) if n not in self.head)

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        return self.model_from(mixed_state(global_state, state, self.body), ctx.device)

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        opt = torch.optim.SGD(model.parameters(), lr=self.train.lr)
        loss = sgd_epochs(model, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator())
        return LocalResult(upload(model, global_state, self.head, data.num_train),
                           personal_state(model, self.body, state), {"train_loss": loss})
