"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the global model into the local one.

On download (Algorithm 1, lines 6-16 of the paper; Eq. 4-5), a client that already has a local model
theta mixes in the new global model theta_g:

    lower tensors:      theta_hat = theta_g
    top ``layers`` (p): theta_hat = theta + (theta_g - theta) * W,     W in [0, 1] element-wise

``W`` is learned by gradient steps on the loss of theta_hat over a random ``rand_fraction`` (80%) of the
client's training split: ``W <- clip(W - eta * grad_theta_hat * (theta_g - theta), 0, 1)`` after every
mini-batch (Eq. 5). ``W`` starts at ones, is kept across rounds (``ala.<name>`` in the client state),
and ALA is skipped in the client's first round (it has no local model yet). In the first round where
ALA runs, W trains epoch after epoch until the standard deviation of the last ``window`` (10) epoch
losses drops below ``loss_std`` (0.1) -- at most ``max_start_epochs`` epochs; afterwards one epoch
per round. Then the client trains theta_hat and uploads all of it.

``layers`` counts parameter tensors from the output side, as PFLlib's ``layer_idx`` does (2 for the
CNN: ``fc.weight`` and ``fc.bias``). Deviations from PFLlib: the recorded loss is each epoch's mean
(PFLlib records the last mini-batch's), the 80% is a random subset (PFLlib takes a random contiguous
window), floating-point buffers outside the top tensors are taken from the global model too, and the
start phase has a hard cap on epochs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import TrainConfig
from ..models import ModelSpec
from ..train import ClientData, batches, sgd_epochs
from .base import ClientState, LocalResult, RoundContext, Strategy
from .partial import PERSONAL, float_names, personal_state, upload

ALA = "ala."
STARTED = "ala_started"
WEIGHTS_ATTR = "ala_weights"  # where receive() leaves the learned W on the model for local_round()


@dataclass(frozen=True)
class FedALAOptions:
    layers: int = 2  # p: top parameter tensors that are mixed element-wise
    eta: float = 1.0  # learning rate of W
    rand_fraction: float = 0.8  # share of the training split W is learned on
    loss_std: float = 0.1  # start phase ends when the last ``window`` epoch losses have a smaller std
    window: int = 10
    max_start_epochs: int = 20  # hard cap on the start phase

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if not self.eta > 0 or not 0 < self.rand_fraction <= 1 or not self.loss_std > 0:
            raise ValueError("eta and loss_std must be > 0 and rand_fraction in (0, 1]")
        if self.window < 2 or self.max_start_epochs < 1:
            raise ValueError("window must be >= 2 and max_start_epochs >= 1")


def ala_mix(local: torch.Tensor, glob: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """FedALA Eq. 4 for one tensor: theta + (theta_g - theta) * W."""
    return local + (glob - local) * weight


class FedALA(Strategy):
    name = "fedala"
    options_type = FedALAOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        params = [n for n, _ in self.new_model().named_parameters()]
        if self.options.layers > len(params):
            raise ValueError(f"[strategy.fedala] layers = {self.options.layers} but the model has only "
                             f"{len(params)} parameter tensors")
        self.top = tuple(params[-self.options.layers:])
        self.names = float_names(self)

    def initial_state(self) -> ClientState:
        return ClientState(scalars={STARTED: 0})

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        """ALA (skipped in the first round). The learned W rides on the returned model as
        ``model.ala_weights`` until :meth:`local_round` puts it in the kept state; ``state`` itself is
        not modified (a client that only evaluates keeps its previous W)."""
        local = state.prefixed(PERSONAL)
        if not local:  # first round: no local model, ALA skipped
            return self.model_from(global_state, ctx.device)
        model = self.model_from(dict(global_state), ctx.device)  # lower tensors <- global
        weights = {n: state.tensors.get(ALA + n, torch.ones_like(global_state[n])) for n in self.top}
        weights, _ = self.learn_weights(model, global_state, local, weights, data, ctx,
                                        start=not bool(state.scalars.get(STARTED, 0)))
        self._mix_into(model, global_state, local, weights)
        setattr(model, WEIGHTS_ATTR, weights)
        return model

    def _mix_into(self, model: nn.Module, global_state: Mapping[str, torch.Tensor],
                  local: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        named = dict(model.named_parameters())
        with torch.no_grad():
            for n in self.top:
                g = global_state[n].to(named[n].device)
                named[n].copy_(ala_mix(local[n].to(g.device), g, weights[n].to(g.device)))

    def learn_weights(self, model: nn.Module, global_state: Mapping[str, torch.Tensor],
                      local: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], data: ClientData,
                      ctx: RoundContext, start: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
        """Learn W (Eq. 5) on a random ``rand_fraction`` of the training split; returns (W, epoch losses).
        ``model`` holds the global lower tensors; its top tensors are overwritten with the mix."""
        o = self.options
        dev = ctx.device
        gen = ctx.generator("ala")
        n = len(data.train)
        k = max(1, int(o.rand_fraction * n))
        subset = data.train.subset(torch.randperm(n, generator=gen)[:k])
        named = dict(model.named_parameters())
        w = {m: weights[m].detach().to(dev).clone() for m in self.top}
        diff = {m: (global_state[m].to(dev) - local[m].to(dev)) for m in self.top}
        loc = {m: local[m].to(dev) for m in self.top}
        saved = {m: p.requires_grad for m, p in named.items()}
        for m, p in named.items():
            p.requires_grad_(m in self.top)
        losses: list[float] = []
        try:
            max_epochs = o.max_start_epochs if start else 1
            for _ in range(max_epochs):
                total, count = 0.0, 0
                for x, y in batches(subset, self.train.batch_size, dev, gen):
                    with torch.no_grad():
                        for m in self.top:
                            named[m].copy_(loc[m] + diff[m] * w[m])
                    model.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    with torch.no_grad():
                        for m in self.top:
                            w[m].sub_(o.eta * named[m].grad * diff[m]).clamp_(0.0, 1.0)
                    total += float(loss.detach()) * int(y.shape[0])
                    count += int(y.shape[0])
                losses.append(total / max(1, count))
                if start and len(losses) >= o.window and float(np.std(losses[-o.window:])) < o.loss_std:
                    break
        finally:
            for m, p in named.items():
                p.requires_grad_(saved[m])
            model.zero_grad(set_to_none=True)
        return {m: v.cpu() for m, v in w.items()}, losses

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        opt = torch.optim.SGD(model.parameters(), lr=self.train.lr)
        loss = sgd_epochs(model, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator())
        kept = personal_state(model, self.names, state)
        weights = getattr(model, WEIGHTS_ATTR, None)
        if weights is not None:
            kept.tensors.update({ALA + n: w for n, w in weights.items()})
            kept.scalars[STARTED] = 1
        return LocalResult(upload(model, global_state, self.names, data.num_train), kept, {"train_loss": loss})
