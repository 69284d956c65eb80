"""FLAYER (arXiv 2412.07062): PLA head init, per-layer learning rates, layer-wise masked uploads.

Two presets share this code and differ only in their option defaults and three rules:

- ``flayer``: the paper's formulas. Layers are the layer plan's modules numbered 1..L; the head is
  the last ``head_layers`` of them (default 1, the classifier); Eq. 4 per layer with a gradient-norm
  floor and a multiplier cap, every step; masks per layer by Eq. 5-9 (the head layer, i = L,
  uploads everything); A_l is the personal model's validation accuracy after its local training.
- ``flayer-ref``: the authors' released code. The head is the last ``s`` parameter tensors (CNN 2,
  ResNet-18 4, fastText 2); Eq. 4 per parameter tensor on the first mini-batch of each epoch,
  averaged per module, x20 for the CNN, first module at eta and the head module at eta/5; masks
  per tensor with a 0.9 cap, per k x k kernel, 2-D weights and the last two tensors whole; the
  head-only epoch at eta/5; A_l measured on the model it evaluates (after PLA and the head-only
  epoch). A_l still comes from the validation hold-out, never the test split.

Client side, per round (see :mod:`flayer.strategies.base`): ``receive`` applies PLA (Eq. 2) and the
head-only epoch (the released code runs it before its evaluation, and so does this one);
``local_round`` trains with the per-layer rates, measures A_l, masks by |change during local
training| and uploads deltas against the downloaded global model at the masked positions. The
client keeps its head and A_l (``personal.<tensor>``, ``acc_val``). Server side: rule ``carry``
(default) or ``zero`` (Algorithm 1 read literally).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..config import TrainConfig
from ..layers import layer_plan
from ..lr import LrRule, layer_optimizer, lr_hook
from ..masks import layer_masks, public_scores, ref_masks
from ..models import ModelSpec
from ..pla import pla_state
from ..sensitivity import DEFAULT_THRESHOLD, aggregate_curves, auto_head_layers, calibration_report
from ..train import ClientData, evaluate, sgd_epochs
from ..update import delta_update, float_state
from .base import ClientState, LocalResult, RoundContext, Strategy, derive_seed

__all__ = ["REF_MODEL_CONSTANTS", "Flayer", "FlayerOptions", "FlayerRef", "FlayerRefOptions"]

log = logging.getLogger(__name__)

PERSONAL = "personal."

# The released code's per-model constants: s (head parameter tensors), L (hard-coded), LR factor.
REF_MODEL_CONSTANTS: dict[str, tuple[int, int, float]] = {
    "cnn": (2, 3, 20.0),
    "resnet18": (4, 6, 1.0),
    "fasttext": (2, 2, 1.0),
}


@dataclass(frozen=True)
class FlayerOptions:
    """``[strategy.flayer]`` / ``--set flayer.KEY=VALUE``. Each switch is one ablation row."""

    # s: head layers (flayer) / tensors (flayer-ref); None = preset default; "auto" = chosen before
    # round 1 from PLayer-FL's federation-sensitivity curve (a calibration round, flayer.sensitivity)
    head_layers: int | Literal["auto"] | None = None
    auto_threshold: float = DEFAULT_THRESHOLD  # "auto": the jump ratio that places the split
    calibration_epochs: int = 1  # "auto": independent local epochs before measuring sensitivity
    sensitivity_batch: int = 128  # "auto": size of the one random batch the metric uses
    layer_paths: tuple[str, ...] = ()  # override the layer plan with explicit module paths
    pla: bool = True  # Eq. 2 head init (off: the global head as is)
    acc_source: Literal["trained", "received"] = "trained"  # A_l: after local training / received model
    head_epoch: bool = True  # one head-only epoch after PLA, before evaluation
    head_epoch_lr: float = 1.0  # its learning rate, as a multiple of the base lr
    lr_rule: bool = True  # Eq. 4 per-layer learning rates (off: the base lr everywhere)
    lr_eps: float = 1e-8  # floor on ||g_i|| in Eq. 4
    lr_cap: float | None = 10.0  # cap on Eq. 4's multiplier
    lr_every: Literal["step", "epoch"] = "step"  # recompute every step, or from each epoch's first batch
    masks: bool = True  # Eq. 5-9 layer-wise upload masks (off: upload everything)
    # which entries of each layer's UP_i share travel: "topk" (largest |change|, Eq. 5-9) or "public" (drawn
    # from the round's public seed, the same for every device: data-independent); None: topk, or public
    # in private rounds (flayer.engine.privacy)
    positions: Literal["topk", "public"] | None = None
    mask_floor: float = 0.1
    mask_cap: float = 1.0
    server_rule: Literal["carry", "zero", "median", "trimmed"] = "carry"
    server_trim: float = 0.2  # rule "trimmed": fraction dropped at each end, per coordinate

    def __post_init__(self) -> None:
        if self.head_layers != "auto" and self.head_layers is not None and self.head_layers < 1:
            raise ValueError(f"head_layers must be >= 1 or \"auto\", got {self.head_layers}")
        if not self.auto_threshold > 1.0 or self.calibration_epochs < 1 or self.sensitivity_batch < 1:
            raise ValueError("need auto_threshold > 1, calibration_epochs >= 1 and sensitivity_batch >= 1")
        if not self.head_epoch_lr > 0:
            raise ValueError(f"head_epoch_lr must be > 0, got {self.head_epoch_lr}")
        if not self.lr_eps > 0:
            raise ValueError(f"lr_eps must be > 0, got {self.lr_eps}")
        if self.lr_cap is not None and not self.lr_cap >= 1:
            raise ValueError(f"lr_cap must be >= 1 (it caps a multiplier >= 1), got {self.lr_cap}")
        if not 0 <= self.server_trim < 0.5:
            raise ValueError(f"server_trim must be in [0, 0.5), got {self.server_trim}")
        if not 0 < self.mask_floor <= self.mask_cap <= 1:
            raise ValueError(f"need 0 < mask_floor <= mask_cap <= 1, got {self.mask_floor}, {self.mask_cap}")


@dataclass(frozen=True)
class FlayerRefOptions(FlayerOptions):
    """``[strategy.flayer-ref]``: the released code's defaults, same switches."""

    acc_source: Literal["trained", "received"] = "received"
    head_epoch_lr: float = 0.2
    lr_cap: float | None = None
    lr_every: Literal["step", "epoch"] = "epoch"
    mask_cap: float = 0.9
    lr_scale: float | None = None  # the model factor of Eq. 4 (None: 20 for the CNN, 1 otherwise)
    ref_layers: int | None = None  # the hard-coded L (None: CNN 3, ResNet-18 6, fastText 2)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lr_scale is not None and not self.lr_scale > 0:
            raise ValueError(f"lr_scale must be > 0, got {self.lr_scale}")
        if self.ref_layers is not None and self.ref_layers < 1:
            raise ValueError(f"ref_layers must be >= 1, got {self.ref_layers}")


def public_seed(ctx: RoundContext) -> int:
    """The round's public seed for the upload positions: (run seed, round), the same for every device."""
    return derive_seed(ctx.seed, ctx.round, "public-positions")


class Flayer(Strategy):
    name = "flayer"
    options_type = FlayerOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(spec, train, options)
        with torch.device("meta"):  # names and shapes only: no memory, no draws from the global RNG
            model = self.new_model()
        o = self.options
        try:
            self.plan = layer_plan(model, self._plan_head_layers(), o.layer_paths or None)
            self.param_names = tuple(n for n, _ in model.named_parameters())
            self.head, self.head_params = self._head()
        except ValueError as exc:
            raise ValueError(f"[strategy.{self.name}]: {exc}") from None
        self._warned_no_val = False
        self._public: tuple[Any, dict[str, torch.Tensor | None]] | None = None  # the last round's public masks

    # ---- the rules the two presets differ in -----------------------------------------------------------
    def _plan_head_layers(self) -> int:
        h = self.options.head_layers
        return 1 if h is None or h == "auto" else h  # "auto": provisional until the calibration

    def _head(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(state tensors PLA mixes and the client keeps, parameters the head-only epoch trains)."""
        return self.plan.tensors(head=True), self.plan.params(head=True)

    def _lr_rule(self) -> LrRule:
        o = self.options
        return LrRule(self.train.lr, o.lr_eps, o.lr_cap, o.lr_every, "flayer")

    def _masks(self, change: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        return layer_masks(change, self.plan, self.options.mask_floor, self.options.mask_cap)

    # ---- head = auto: PLayer-FL's sensitivity curve picks s (round 0) -----------------------------------
    def needs_calibration(self) -> bool:
        return self.options.head_layers == "auto"

    def calibrate(self, global_state: Mapping[str, torch.Tensor], data: ClientData,
                  ctx: RoundContext) -> dict[str, float]:
        plan = self.plan.with_head(0)
        return calibration_report(self.model_from(global_state, ctx.device), plan, data.train, self.train.lr,
                                  self.train.batch_size, self.options.calibration_epochs,
                                  self.options.sensitivity_batch, ctx.device, ctx.generator("calibrate"))

    def resolve_calibration(self, reports: Sequence[Mapping[str, float]],
                            weights: Sequence[float]) -> dict[str, Any]:
        """The sample-weighted mean curve decides how many layers stay local (the head)."""
        curve = aggregate_curves(reports, weights, self.plan.num_layers)
        return {"head_layers": self._head_setting(auto_head_layers(curve, self.options.auto_threshold))}

    def _head_setting(self, layers: int) -> int:
        """``head_layers`` for a head of ``layers`` layers (flayer counts layers)."""
        return max(1, layers)

    # ---- client side -----------------------------------------------------------------------------------
    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        """Download: PLA (Eq. 2) with the kept head and A_l, then the head-only epoch."""
        start: Mapping[str, torch.Tensor] = global_state
        local_head = state.prefixed(PERSONAL)
        if self.options.pla and local_head:
            acc = state.scalars.get("acc_val", 0.0)
            if isinstance(acc, bool) or not isinstance(acc, (int, float)):
                raise ValueError(f"client state: acc_val must be a number in [0, 1], got {acc!r}")
            start = pla_state(global_state, local_head, self.head, float(acc))
        model = self.model_from(start, ctx.device)
        if self.options.head_epoch:
            self._head_epoch(model, data, ctx)
        return model

    def _head_epoch(self, model: nn.Module, data: ClientData, ctx: RoundContext) -> None:
        """One epoch of SGD on the head parameters only (the body is frozen, so backward stops at
        the head)."""
        head = set(self.head_params)
        frozen = [p for n, p in model.named_parameters() if n not in head and p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            opt = torch.optim.SGD([p for n, p in model.named_parameters() if n in head],
                                  lr=self.train.lr * self.options.head_epoch_lr)
            sgd_epochs(model, data.train, opt, 1, self.train.batch_size, ctx.device, ctx.generator("head"))
        finally:
            for p in frozen:
                p.requires_grad_(True)

    def _val_acc(self, model: nn.Module, data: ClientData, ctx: RoundContext) -> float:
        """A_l: accuracy on the client's validation hold-out (0 without one: PLA keeps the global head)."""
        correct, total, _ = evaluate(model, data.val, ctx.device)
        if total == 0 and not self._warned_no_val:
            log.warning("client %d has no validation samples: A_l = 0, so PLA keeps the global head "
                        "(set [data] val_fraction > 0)", ctx.client)
            self._warned_no_val = True
        return correct / total if total else 0.0

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        o = self.options
        params = dict(model.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()} if o.masks else {}
        acc = self._val_acc(model, data, ctx) if o.acc_source == "received" else 0.0
        if o.lr_rule:
            opt = layer_optimizer(model, self.plan, self.train.lr)
            hook = lr_hook(opt, self._lr_rule())
        else:
            opt, hook = torch.optim.SGD(model.parameters(), lr=self.train.lr), None
        loss = sgd_epochs(model, data.train, opt, self.train.local_epochs, self.train.batch_size, ctx.device,
                          ctx.generator(), before_step=hook)
        if o.acc_source == "trained":
            acc = self._val_acc(model, data, ctx)
        local = float_state(model)
        masks: dict[str, torch.Tensor | None] = {n: None for n in local}
        if o.masks:
            change = {n: params[n].detach() - before[n] for n in before}
            masks.update(self.public_masks(change, public_seed(ctx)) if o.positions == "public" else self._masks(change))
        update = delta_update(local, global_state, masks, data.num_train, {"acc_val": acc})
        participations = int(state.scalars.get("participations", 0)) + 1
        kept = ClientState({PERSONAL + n: local[n] for n in self.head},
                           {"acc_val": acc, "participations": participations})
        return LocalResult(update, kept, {"train_loss": loss, "acc_val": acc,
                                          "upload_fraction": update.sent / max(1, update.numel)})

    def public_masks(self, change: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor | None]:
        """The masks of the round's public positions: a function of the public ``seed`` and the tensors' names and
        shapes alone, the same for every device of the round, so they are computed once a round and shared (the
        positions are read, never written, by :func:`flayer.update.delta_update`)."""
        key = (seed, tuple((n, tuple(t.shape)) for n, t in sorted(change.items())))
        cached = self._public
        if cached is None or cached[0] != key:
            cached = self._public = (key, self._masks(public_scores(change, seed)))
        return dict(cached[1])

    # ---- server side -----------------------------------------------------------------------------------
    def server_rule(self) -> str:
        return self.options.server_rule

    def server_trim(self) -> float:
        return self.options.server_trim


class FlayerRef(Flayer):
    """``flayer-ref``: the authors' released code's behaviour (see the module docstring)."""

    name = "flayer-ref"
    options_type = FlayerRefOptions

    def _constants(self) -> tuple[int, int, float]:
        return REF_MODEL_CONSTANTS.get(self.spec.name, (2, self.plan.num_layers - 1, 1.0))

    def _plan_head_layers(self) -> int:
        return 1  # the plan only groups modules here; the head is counted in tensors (_head)

    def _head_setting(self, layers: int) -> int:
        """flayer-ref counts its head in parameter tensors: those of the last ``layers`` layers."""
        return len(self.plan.with_head(max(1, layers)).params(head=True))

    def _head(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        h = self.options.head_layers
        s = self._constants()[0] if h is None or h == "auto" else h
        if s > len(self.param_names):
            raise ValueError(f"head_layers {s} exceeds the model's {len(self.param_names)} parameter tensors")
        head = self.param_names[-s:]
        return head, head

    def _lr_rule(self) -> LrRule:
        o = self.options
        _, ref_l, scale = self._constants()
        return LrRule(self.train.lr, o.lr_eps, o.lr_cap, o.lr_every, "ref",
                      o.ref_layers or max(1, ref_l), scale if o.lr_scale is None else o.lr_scale)

    def _masks(self, change: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        return ref_masks(change, self.param_names, floor=self.options.mask_floor, cap=self.options.mask_cap)
