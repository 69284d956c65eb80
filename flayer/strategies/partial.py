"""Pieces the layer-splitting baselines share (FedPer, FedRep, LG-FedAvg, FedBABU, PLayer-FL, Local).

A split is a :class:`~flayer.layers.LayerPlan`: the last ``head_layers`` layers are the head, the rest
the body. Personal tensors live in the client state under ``personal.<name>``. These are plain
functions so each strategy file reads top to bottom.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..layers import LayerPlan, layer_plan
from ..train import ClientData, sgd_epochs
from ..update import Update, delta_update, float_state
from .base import ClientState, RoundContext, Strategy

__all__ = [
    "PERSONAL",
    "HeadOptions",
    "float_names",
    "mixed_state",
    "personal_state",
    "plan_for",
    "train_only",
    "upload",
]

PERSONAL = "personal."


@dataclass(frozen=True)
class HeadOptions:
    """``head_layers``: how many layers, counted from the output side, form the head (default: the
    last layer, ``fc`` in the built-in models)."""

    head_layers: int = 1

    def __post_init__(self) -> None:
        if self.head_layers < 0:
            raise ValueError(f"head_layers must be >= 0, got {self.head_layers}")


def plan_for(strategy: Strategy, head_layers: int) -> LayerPlan:
    """The strategy's model's layer plan with ``head_layers`` head layers (ValueError if too many)."""
    plan = layer_plan(strategy.new_model(), 0)
    if head_layers > plan.num_layers:
        raise ValueError(f"[strategy.{strategy.name}] head_layers = {head_layers} but the model has only "
                         f"{plan.num_layers} layers")
    return plan.with_head(head_layers)


def float_names(strategy: Strategy) -> tuple[str, ...]:
    """Every floating-point state tensor of the strategy's model (what a dense upload holds)."""
    return tuple(k for k, v in strategy.new_model().state_dict().items() if v.is_floating_point())


def mixed_state(global_state: Mapping[str, torch.Tensor], state: ClientState,
                personal: Collection[str]) -> dict[str, torch.Tensor]:
    """The global state with the tensors in ``personal`` replaced by the client's kept copies (a client
    that has none yet -- its first round -- takes the global values)."""
    kept = state.prefixed(PERSONAL)
    return {k: (kept[k] if k in personal and k in kept else v) for k, v in global_state.items()}


def personal_state(model: nn.Module, names: Iterable[str], state: ClientState | None = None) -> ClientState:
    """A client state keeping ``model``'s tensors ``names`` as ``personal.<name>`` (other entries of
    ``state`` are carried over)."""
    local = float_state(model)
    out = state.copy() if state is not None else ClientState()
    for n in names:
        out.tensors[PERSONAL + n] = local[n]
    return out


def train_only(model: nn.Module, trainable: Collection[str], data: ClientData, lr: float, epochs: int,
               batch_size: int, ctx: RoundContext, purpose: str = "train") -> float:
    """SGD on ``trainable`` parameters only (the others frozen: no gradient, no update); returns the
    mean training loss. Restores ``requires_grad`` afterwards."""
    params = [p for n, p in model.named_parameters() if n in trainable]
    if not params or epochs <= 0:
        return float("nan")
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in trainable)
    try:
        opt = torch.optim.SGD(params, lr=lr)
        return sgd_epochs(model, data.train, opt, epochs, batch_size, ctx.device, ctx.generator(purpose))
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])


def upload(model: nn.Module, global_state: Mapping[str, torch.Tensor], names: Iterable[str],
           num_samples: int) -> Update:
    """Dense deltas of the tensors ``names`` (and only those) against the global model."""
    return delta_update(float_state(model), global_state, {n: None for n in names}, num_samples)
