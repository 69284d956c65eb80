"""Parity and speed of an exported model against torch eager, on the same inputs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["NonFiniteModel", "Parity", "Runner", "check_finite", "latency_ms", "max_abs_diff", "parity",
           "torch_runner"]

Runner = Callable[[torch.Tensor], torch.Tensor]
"""Runs one batch through a model (torch eager, onnxruntime or ExecuTorch) and returns logits."""


class NonFiniteModel(ValueError):
    """The torch model itself gives NaN or infinite outputs: there is nothing to compare against."""


def check_finite(reference: Runner, inputs: Sequence[torch.Tensor]) -> None:
    """Raise :class:`NonFiniteModel` if ``reference`` gives a non-finite output on any of ``inputs``."""
    for x in inputs:
        out = reference(x)
        if not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).sum())
            raise NonFiniteModel(f"the model's own outputs are not finite ({bad} of {out.numel()} logits on a "
                                 f"sample batch of {int(x.shape[0])}); it has diverged and is not worth deploying")


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float  # over all sample batches and logits
    batches: tuple[int, ...]  # batch sizes checked
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"output shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a.detach().double() - b.detach().double()).abs().max())


def torch_runner(model: nn.Module) -> Runner:
    model.eval()

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return run


def parity(reference: Runner, candidate: Runner, inputs: Sequence[torch.Tensor], tolerance: float) -> Parity:
    """Max abs difference of ``candidate``'s outputs to ``reference``'s over ``inputs``.

    A non-finite output counts as an infinite difference; a non-finite reference raises
    :class:`NonFiniteModel`.
    """
    check_finite(reference, inputs)
    worst = 0.0
    for x in inputs:
        ref, out = reference(x), candidate(x)
        if not bool(torch.isfinite(out).all()):
            worst = float("inf")
            continue
        worst = max(worst, max_abs_diff(ref, out))
    return Parity(worst, tuple(int(x.shape[0]) for x in inputs), tolerance)


def latency_ms(run: Runner, x: torch.Tensor, repeats: int = 50, warmup: int = 5) -> float:
    """Median wall time of one call on ``x``, per sample, in milliseconds."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        run(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times) / int(x.shape[0])
