"""``--runtime executorch``: a strategy's local SGD epochs through an ExecuTorch training program.

:class:`ExecuTorchEngine` is a :class:`flayer.train.TrainingEngine`: within
``flayer.train.training_engine(engine)``, every :func:`flayer.train.sgd_epochs` of the strategy (the
local round, FLAYER's head-only epoch, FedRep's and FedBABU's head epochs and fine-tune) runs its
forward, backward and SGD steps in the ``.pte`` program of :mod:`export.et_training` instead of
torch autograd. The batches are the same (same order, same generator), FLAYER's per-layer learning
rates are read from the gradients the program returns and applied as per-group ExecuTorch SGD
steps, and frozen parameters (``requires_grad`` False) are not stepped, as in torch.

What stays in torch: evaluation (forward only), PLA's mixing, masks and the update's encoding,
PLayer-FL's calibration sensitivity. What it refuses, with the reason: models without a correct
training program (ResNet-18: BatchNorm; see :func:`export.et_training.check_training_support`),
strategies whose training is not plain SGD on cross-entropy (:data:`UNSUPPORTED_STRATEGIES`),
optimizers with momentum, weight decay, dampening or Nesterov, batches above the program's bound,
and devices other than the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flayer.spec import ModelSpec
from flayer.train import Split, batches

from .deps import require_executorch
from .et_round import TrainingProgram
from .et_training import DEFAULT_TRAIN_MAX_BATCH, UnsupportedModel, check_training_support

__all__ = ["UNSUPPORTED_STRATEGIES", "ExecuTorchEngine", "UnsupportedTraining", "check_model", "check_strategy"]

log = logging.getLogger(__name__)

UNSUPPORTED_STRATEGIES: dict[str, str] = {
    "ditto": "its personal model trains on a custom loss (the proximal term), which the program does not have",
    "fedala": "its adaptive local aggregation learns element-wise weights with torch autograd",
}


class UnsupportedTraining(ValueError):
    """This training cannot run through the ExecuTorch program; the message says why."""


def check_strategy(name: str, spec: ModelSpec) -> None:
    """Raise :class:`UnsupportedTraining` when strategy ``name`` on ``spec``'s model cannot train
    through ExecuTorch."""
    if name in UNSUPPORTED_STRATEGIES:
        raise UnsupportedTraining(f"strategy {name!r} cannot train with runtime executorch: "
                                  f"{UNSUPPORTED_STRATEGIES[name]}; use runtime torch")
    check_model(spec)


def check_model(spec: ModelSpec) -> None:
    """Raise :class:`UnsupportedTraining` when ``spec``'s model has no training program with torch parity."""
    try:
        check_training_support(spec)
    except UnsupportedModel as exc:
        raise UnsupportedTraining(f"model {spec.name!r} cannot train with runtime executorch: {exc}") from exc


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) is not torch.optim.SGD:
        raise UnsupportedTraining(f"runtime executorch runs plain SGD; got {type(optimizer).__name__}")
    for i, g in enumerate(optimizer.param_groups):
        extras = {k: g.get(k) for k in ("momentum", "weight_decay", "dampening") if g.get(k)}
        if extras or g.get("nesterov") or g.get("maximize"):
            raise UnsupportedTraining(f"runtime executorch runs plain SGD; parameter group {i} asks for "
                                      f"{extras or 'nesterov/maximize'}")


class ExecuTorchEngine:
    """The training program of one model spec, loaded once and reused for every round."""

    name = "executorch"

    def __init__(self, spec: ModelSpec, max_batch: int = DEFAULT_TRAIN_MAX_BATCH) -> None:
        check_model(spec)
        require_executorch()
        self.spec = spec
        self.max_batch = max_batch
        self._program: TrainingProgram | None = None
        self.steps = 0  # SGD steps run through the program (for reports and tests)

    @property
    def program(self) -> TrainingProgram:
        if self._program is None:
            log.info("exporting the ExecuTorch training program of %s (batch up to %d)", self.spec.name,
                     self.max_batch)
            self._program = TrainingProgram.for_spec(self.spec, self.max_batch)
        return self._program

    def sgd_epochs(self, model: nn.Module, split: Split, optimizer: torch.optim.Optimizer, epochs: int,
                   batch_size: int, device: torch.device, generator: torch.Generator,
                   before_step: Callable[[int, int], None] | None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> float:
        if loss_fn is not None:
            raise UnsupportedTraining("runtime executorch trains on the program's cross-entropy; this strategy "
                                      "asked for a custom loss")
        if device.type != "cpu":
            raise UnsupportedTraining(f"runtime executorch runs on the CPU, not on {device}")
        if batch_size > self.max_batch:
            raise UnsupportedTraining(f"batch size {batch_size} exceeds the training program's bound "
                                      f"{self.max_batch}")
        _check_optimizer(optimizer)
        prog = self.program
        named = dict(model.named_parameters())
        if set(named) != set(prog.names):
            raise UnsupportedTraining(f"the model's parameters do not match the {self.spec.name} training program")
        by_id = {id(p): n for n, p in named.items()}
        prog.load_state({n: p.detach() for n, p in named.items()})
        model.train()
        key: Any = None
        steppers: list[tuple[Any, list[str]]] = []
        total, count = 0.0, 0
        for epoch in range(epochs):
            for step, (x, y) in enumerate(batches(split, batch_size, device, generator, drop_last=True)):
                loss, grads = prog.forward_backward(x, y)
                if before_step is not None:  # e.g. FLAYER's Eq. 4 reads the gradients from .grad
                    for n, p in named.items():
                        p.grad = grads[n] if p.requires_grad else None
                    before_step(epoch, step)
                groups = [([by_id[id(p)] for p in g["params"] if p.requires_grad], float(g["lr"]))
                          for g in optimizer.param_groups]
                new_key = [(tuple(ns), lr) for ns, lr in groups]
                if new_key != key:  # per-layer learning rates changed: new per-group optimizers
                    steppers, key = prog.optimizers(groups), new_key
                prog.step(steppers, grads)
                total += loss * int(y.shape[0])
                count += int(y.shape[0])
                self.steps += 1
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(prog.weight(n))
                p.grad = None
        return total / max(1, count)
