"""Ditto (Li et al., ICML 2021): a global model trained as in FedAvg, and a personal model pulled
towards it by a proximal term.

Per round, on a selected client: the personal model v (kept in the state as ``personal.<name>``;
the common initial model before the first round) takes ``personal_epochs`` of SGD on
``CE(v) + mu/2 * ||v - w_global||^2`` (gradient ``g + mu (v - w_global)``, PFLlib's
PerturbedGradientDescent); then a copy of the global model takes ``local_epochs`` of plain SGD and
is uploaded whole. The personal model is what the client evaluates and deploys.

``mu`` must be non-zero to personalise *with* the federation (mu = 0, PFLlib's default, is plain
local training). Default 0.1: the middle of the range the Ditto paper tunes over
({0.01, 0.1, 1, 2}) and the value PLayer-FL's released configuration uses for Ditto on every data
set; set it explicitly with ``--set ditto.mu=...``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..models import ModelSpec
from ..train import ClientData, sgd_epochs
from .base import ClientState, LocalResult, RoundContext, Strategy
from .partial import float_names, mixed_state, personal_state, upload


@dataclass(frozen=True)
class DittoOptions:
    mu: float = 0.1
    personal_epochs: int = 1

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")
        if self.personal_epochs < 1:
            raise ValueError(f"personal_epochs must be >= 1, got {self.personal_epochs}")


class Ditto(Strategy):
    name = "ditto"
    options_type = DittoOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        self.names = float_names(self)

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        """The personal model (what is evaluated); nothing is overwritten by the download."""
        return self.model_from(mixed_state(global_state, state, self.names), ctx.device)

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        mu = self.options.mu
        named = [(p, global_state[n].to(ctx.device)) for n, p in model.named_parameters()]

        def proximal(epoch: int, step: int) -> None:
            if mu:
                with torch.no_grad():
                    for p, g in named:
                        if p.grad is not None:
                            p.grad.add_(p.detach() - g, alpha=mu)

        popt = torch.optim.SGD(model.parameters(), lr=self.train.lr)
        ploss = sgd_epochs(model, data.train, popt, self.options.personal_epochs, self.train.batch_size, ctx.device,
                           ctx.generator("personal"), before_step=proximal)
        glob = self.model_from(global_state, ctx.device)
        opt = torch.optim.SGD(glob.parameters(), lr=self.train.lr)
        loss = sgd_epochs(glob, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator())
        return LocalResult(upload(glob, global_state, self.names, data.num_train),
                           personal_state(model, self.names, state), {"train_loss": loss, "personal_loss": ploss})
