"""PLayer-FL (Elhussein & Gursoy, arXiv 2502.08829): federate the layers up to a split chosen from
the clients' federation sensitivity, keep the rest local.

Calibration ("round 0", only while ``split`` is unset): every client trains one epoch from the common
initial model without federation and reports its federation-sensitivity curve F_1..F_L on one random
batch (:func:`flayer.sensitivity.calibration_report`); the server averages the normalised curves
(sample-weighted) and places the split before the first jump above ``threshold``
(:func:`flayer.sensitivity.split_layer`). The decision travels as the option ``split``.

Federation with ``split = s``: layers 1..s <- global on download and uploaded (FedAvg, sample-weighted);
layers s+1..L stay on the client (``personal.<name>``). Every layer trains each round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..layers import layer_plan
from ..models import ModelSpec
from ..sensitivity import DEFAULT_THRESHOLD, aggregate_curves, calibration_report, split_layer
from ..train import ClientData, sgd_epochs
from .base import ClientState, LocalResult, RoundContext, Strategy
from .partial import float_names, mixed_state, personal_state, upload


@dataclass(frozen=True)
class PLayerFLOptions:
    split: int | None = None  # federated layers from the input side; None = decided by calibration
    threshold: float = DEFAULT_THRESHOLD  # jump threshold t of the split rule
    calibration_epochs: int = 1  # independent local epochs before the metric (the paper: one)
    sensitivity_batch: int = 128  # samples in the one random batch (PLayer-FL's FMNIST batch size)

    def __post_init__(self) -> None:
        if self.split is not None and self.split < 0:
            raise ValueError(f"split must be >= 0, got {self.split}")
        if not self.threshold > 1:
            raise ValueError(f"threshold must be > 1, got {self.threshold}")
        if self.calibration_epochs < 1 or self.sensitivity_batch < 1:
            raise ValueError("calibration_epochs and sensitivity_batch must be >= 1")


class PLayerFL(Strategy):
    name = "playerfl"
    options_type = PLayerFLOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        self.plan = layer_plan(self.new_model(), 0)
        split = self.options.split
        if split is not None and split > self.plan.num_layers:
            raise ValueError(f"[strategy.playerfl] split = {split} but the model has {self.plan.num_layers} layers")
        if split is not None:
            self.plan = self.plan.with_head(self.plan.num_layers - split)
        self.local_part = self.plan.tensors(head=True) if split is not None else ()
        self.shared = tuple(n for n in float_names(self) if n not in self.local_part)

    # ---- calibration --------------------------------------------------------------------------
    def needs_calibration(self) -> bool:
        return self.options.split is None

    def calibrate(self, global_state: Mapping[str, torch.Tensor], data: ClientData,
                  ctx: RoundContext) -> dict[str, float]:
        model = self.model_from(global_state, ctx.device)
        return calibration_report(model, self.plan, data.train, self.train.lr, self.train.batch_size,
                                  self.options.calibration_epochs, self.options.sensitivity_batch, ctx.device,
                                  ctx.generator("calibrate"))

    def resolve_calibration(self, reports: Sequence[Mapping[str, float]],
                            weights: Sequence[float]) -> dict[str, Any]:
        curve = aggregate_curves(reports, weights, self.plan.num_layers)
        return {"split": split_layer(curve, self.options.threshold)}

    # ---- federation ---------------------------------------------------------------------------
    def _require_split(self) -> None:
        if self.options.split is None:
            raise RuntimeError("playerfl: the split is not set; run the calibration first (or set "
                               "[strategy.playerfl] split)")

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        self._require_split()
        return self.model_from(mixed_state(global_state, state, self.local_part), ctx.device)

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        self._require_split()
        opt = torch.optim.SGD(model.parameters(), lr=self.train.lr)
        loss = sgd_epochs(model, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator())
        return LocalResult(upload(model, global_state, self.shared, data.num_train),
                           personal_state(model, self.local_part, state), {"train_loss": loss})
