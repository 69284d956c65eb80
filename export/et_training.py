"""ExecuTorch training programs: which models can train through them, and how the program is made.

A training program is the model's joint forward + backward graph with the cross-entropy loss inside
it (``torch.export`` -> ``torch.export.experimental._export_forward_backward`` -> ``to_edge`` ->
``to_executorch``), run by ``executorch.extension.training`` on portable CPU kernels. It returns the
loss, the gradient of every parameter and the parameters themselves; an SGD optimizer updates the
parameters in place. A device without torch runs the same ``.pte`` through ExecuTorch's C++, Java or
Objective-C training API.

ExecuTorch's training support is experimental; measured with executorch 1.5.1:

- ``max_pool2d``'s backward kernel is wrong (the gradient upstream of the pool differs from torch by
  orders of magnitude), so FedAvgCNN trains with its 2x2 pool written as reshape + amax
  (:class:`flayer.models.MaxPool2x2`, the same forward and the same state dict).
- ``avg_pool2d``'s backward has no kernel (loading works, running fails with OperatorMissing).
- BatchNorm in train mode does not export (no out variant of
  ``aten::_native_batch_norm_legit_functional``); frozen BatchNorm would change what the model
  learns, so ResNet-18 is refused.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from flayer.models import FedAvgCNN, ModelSpec, build_model, cnn_flatten_dim

from .deps import require_executorch
from .inputs import DEFAULT_SEQ_LEN, batch_dim, sample_input, sample_labels

__all__ = [
    "DEFAULT_TRAIN_MAX_BATCH",
    "PARAM_PREFIX",
    "UnsupportedModel",
    "WithLoss",
    "check_module_support",
    "check_training_support",
    "export_training_program",
    "lower_training_program",
    "training_model",
]

log = logging.getLogger(__name__)

DEFAULT_TRAIN_MAX_BATCH = 128
PARAM_PREFIX = "model."  # the program names parameters after the WithLoss wrapper's attribute

_RESNET_REASON = (
    "ResNet-18 cannot train through ExecuTorch 1.5.1: its BatchNorm layers in train mode do not export "
    "(no out variant of aten::_native_batch_norm_legit_functional), frozen BatchNorm would change what the "
    "model learns, and the 'imagenet' stem's 3x3 max-pool has a wrong backward kernel. Train ResNet-18 "
    "with torch (the default runtime)."
)


class UnsupportedModel(ValueError):
    """The model cannot train through an ExecuTorch training program; the message says why."""


def check_training_support(spec: ModelSpec) -> None:
    """Return if ``spec``'s model trains through ExecuTorch with torch parity, else raise
    :class:`UnsupportedModel` with the reason.

    Supported: ``cnn`` (FedAvgCNN, with its max-pools written as reshape + amax), ``fasttext``, and a
    user model (an entry point) none of whose modules :func:`check_module_support` refuses.
    """
    if spec.name == "resnet18":
        raise UnsupportedModel(_RESNET_REASON)
    if not spec.builtin:
        check_module_support(build_model(spec))
    elif spec.name not in ("cnn", "fasttext"):
        raise UnsupportedModel(f"no ExecuTorch training program for model {spec.name!r}")


_WRONG_BACKWARD: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.MaxPool1d, "max-pool backward kernels are wrong in ExecuTorch 1.5.1"),
    (nn.MaxPool2d, ("max_pool2d's backward kernel is wrong in ExecuTorch 1.5.1 (write a 2x2 pool as reshape + "
                    "amax, e.g. FedAvgCNN(pool='reshape'))")),
    (nn.MaxPool3d, "max-pool backward kernels are wrong in ExecuTorch 1.5.1"),
    (nn.AvgPool1d, "avg-pool backward has no ExecuTorch 1.5.1 kernel"),
    (nn.AvgPool2d, "avg_pool2d's backward has no ExecuTorch 1.5.1 kernel"),
    (nn.AvgPool3d, "avg-pool backward has no ExecuTorch 1.5.1 kernel"),
)


def check_module_support(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModel` naming the first submodule whose backward ExecuTorch gets wrong
    or cannot run (max/avg pools, BatchNorm in train mode)."""
    for name, module in model.named_modules():
        for kind, reason in _WRONG_BACKWARD:
            if isinstance(module, kind):
                raise UnsupportedModel(f"module {name or '<root>'} ({type(module).__name__}): {reason}")
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise UnsupportedModel(f"module {name} ({type(module).__name__}): BatchNorm in train mode does not "
                                   f"export to an ExecuTorch training program (freeze it or use GroupNorm)")


def training_model(spec: ModelSpec) -> nn.Module:
    """A fresh model of ``spec`` in the form that trains correctly through ExecuTorch (same state dict
    names and shapes as :func:`flayer.models.build_model`)."""
    check_training_support(spec)
    if spec.name == "cnn":
        return FedAvgCNN(spec.in_channels, spec.num_classes, cnn_flatten_dim(spec.height, spec.width), pool="reshape")
    return build_model(spec)


class WithLoss(nn.Module):
    """The model followed by mean cross-entropy: the loss lives inside the exported graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


def export_training_program(model: nn.Module, spec: ModelSpec, max_batch: int = DEFAULT_TRAIN_MAX_BATCH,
                            seq_len: int = DEFAULT_SEQ_LEN) -> bytes:
    """The ``.pte`` bytes of ``model``'s training program (loss, gradients, parameters), batch dynamic
    up to ``max_batch`` (and text length up to ``seq_len`` for fastText). The program's initial weights
    are ``model``'s; :class:`export.et_round.TrainingProgram` loads any state into it.

    Raises :class:`UnsupportedModel` for a model whose gradients would not match torch.
    """
    check_training_support(spec)
    check_module_support(model)
    return lower_training_program(model, spec, max_batch, seq_len)


def lower_training_program(model: nn.Module, spec: ModelSpec, max_batch: int = DEFAULT_TRAIN_MAX_BATCH,
                           seq_len: int = DEFAULT_SEQ_LEN) -> bytes:
    """:func:`export_training_program` without the support checks (to measure what goes wrong)."""
    require_executorch()
    from executorch.exir import EdgeCompileConfig, to_edge
    from torch.export.experimental import _export_forward_backward

    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    gen = torch.Generator().manual_seed(0)
    x = sample_input(spec, 2, gen, seq_len=min(seq_len, DEFAULT_SEQ_LEN))
    y = sample_labels(spec, 2, gen)
    b = batch_dim(max_batch)
    x_dims = {0: b}
    if spec.name == "fasttext":
        from torch.export import Dim

        x_dims[1] = Dim("length", min=1, max=seq_len)
    model.train()
    program = torch.export.export(WithLoss(model), (x, y), dynamic_shapes=(x_dims, {0: b}), strict=True)
    joint = _export_forward_backward(program)
    edge = to_edge(joint, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    buffer = edge.to_executorch().buffer
    log.info("training program for %s: %d bytes", spec.name, len(buffer))
    return bytes(buffer)
