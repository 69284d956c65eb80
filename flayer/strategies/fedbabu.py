"""FedBABU (Oh et al., ICLR 2022): federate the body with the head frozen at its random
initialisation; fine-tune the whole model on each client at the end.

During the federation the head is the common random head of the initial global model: nobody
trains or uploads it, so the server keeps it unchanged ("carry"). Download: every tensor <- global.
Local round: train the body only (head frozen); upload the body. The deployed model
(:meth:`personal_model`) is the final global model fine-tuned, all layers, for ``finetune_epochs``
(PFLlib's default 10) on the client's training split.
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
from .partial import HeadOptions, float_names, plan_for, train_only, upload


@dataclass(frozen=True)
class FedBABUOptions(HeadOptions):
    finetune_epochs: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finetune_epochs < 0:
            raise ValueError(f"finetune_epochs must be >= 0, got {self.finetune_epochs}")


class FedBABU(Strategy):
    name = "fedbabu"
    options_type = FedBABUOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        self.plan = plan_for(self, self.options.head_layers)
        self.head = self.plan.tensors(head=True)
        self.body = tuple(n for n in float_names(self) if n not in self.head)

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        loss = train_only(model, set(self.plan.params(head=False)), data, self.train.lr, self.train.local_epochs,
                          self.train.batch_size, ctx)
        return LocalResult(upload(model, global_state, self.body, data.num_train), state, {"train_loss": loss})

    def personal_model(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                       ctx: RoundContext) -> nn.Module:
        model = self.receive(global_state, state, data, ctx)
        train_only(model, set(self.plan.params()), data, self.train.lr, self.options.finetune_epochs,
                   self.train.batch_size, ctx, "finetune")
        return model
