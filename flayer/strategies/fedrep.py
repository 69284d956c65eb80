"""FedRep (Collins et al., 2021): a shared representation (body) and a personal head.

Download: body <- global, head <- the client's own head. Local round: first ``head_epochs`` epochs on
the head with the body frozen, then ``local_epochs`` on the body with the head frozen (PFLlib's order
and default of 1 head epoch); upload the body; keep the head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..models import ModelSpec
from ..train import ClientData
from .base import ClientState, LocalResult, RoundContext, Strategy
from .partial import HeadOptions, float_names, mixed_state, personal_state, plan_for, train_only, upload


@dataclass(frozen=True)
class FedRepOptions(HeadOptions):
    head_epochs: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_epochs < 1:
            raise ValueError(f"head_epochs must be >= 1, got {self.head_epochs}")


class FedRep(Strategy):
    name = "fedrep"
    options_type = FedRepOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        self.plan = plan_for(self, self.options.head_layers)
        self.head = self.plan.tensors(head=True)
        self.body = tuple(n for n in float_names(self) if n not in self.head)

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        return self.model_from(mixed_state(global_state, state, self.head), ctx.device)

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        head_params, body_params = set(self.plan.params(head=True)), set(self.plan.params(head=False))
        head_loss = train_only(model, head_params, data, self.train.lr, self.options.head_epochs,
                               self.train.batch_size, ctx, "head")
        loss = train_only(model, body_params, data, self.train.lr, self.train.local_epochs, self.train.batch_size,
                          ctx, "body")
        return LocalResult(upload(model, global_state, self.body, data.num_train),
                           personal_state(model, self.head, state), {"train_loss": loss, "head_loss": head_loss})
