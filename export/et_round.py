"""A local round of SGD through an ExecuTorch training program (the path for devices without torch).

:class:`TrainingProgram` loads the ``.pte`` made by :func:`export.et_training.export_training_program`,
loads a model state into it, and runs SGD steps with ExecuTorch's optimizer: one optimizer per
parameter group, so per-layer learning rates (FLAYER Eq. 3-4) are per-group SGD steps. Supported:
plain SGD (no momentum, no weight decay), mean cross-entropy, any batch size up to the program's
bound. :func:`torch_round` is the same round in torch, the reference for parity.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flayer.models import ModelSpec

from .deps import require_executorch
from .et_training import (DEFAULT_TRAIN_MAX_BATCH, PARAM_PREFIX, check_training_support, export_training_program,
                          training_model)
from .inputs import sample_input, sample_labels

__all__ = ["BeforeStep", "Group", "RoundResult", "TrainingProgram", "export_isolated", "torch_round",
           "validate_groups"]

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
Group = tuple[Sequence[str], float]
"""(parameter names, learning rate); parameters in no group are not updated (as with torch param groups)."""

BeforeStep = Callable[[int, Mapping[str, torch.Tensor]], "Sequence[Group] | None"]
"""Called after each backward with (step, gradients by name); returns new groups (e.g. FLAYER's
per-layer learning rates from the first batch's gradient norms) or None to keep the current ones."""


@dataclass(frozen=True)
class RoundResult:
    state: dict[str, torch.Tensor]  # parameters after the round (copies)
    mean_loss: float  # sample-weighted mean training loss over the steps
    steps: int
    samples: int
    losses: tuple[float, ...] = ()  # per step


def _export(spec: ModelSpec, max_batch: int) -> bytes:
    return export_training_program(training_model(spec), spec, max_batch)


def export_isolated(spec: ModelSpec, max_batch: int = DEFAULT_TRAIN_MAX_BATCH) -> bytes:
    """The training program of ``spec``'s model, exported in a spawned child process.

    While ``torch.export`` traces, it patches process-wide state -- ``torch.nn.Module.__call__`` and
    FX's node-meta preservation -- so any other thread of the process that trains or evaluates a model
    meanwhile (another device of the emulator, or of a test's federation) runs through the tracer and
    fails at random. A child process has none of the parent's threads; the program comes back as bytes.
    Raises UnsupportedModel (checked here first, then by the child's export).
    """
    check_training_support(spec)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_export, spec, max_batch).result()


def validate_groups(groups: Sequence[Group], names: Iterable[str]) -> list[tuple[list[str], float]]:
    """Check that every name is a known parameter, appears at most once, and every lr is finite and >= 0."""
    known: set[str] = set(names)
    seen: set[str] = set()
    out = []
    for i, (group_names, lr) in enumerate(groups):
        lr = float(lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"group {i}: learning rate must be finite and >= 0, got {lr}")
        group = list(group_names)
        unknown = [n for n in group if n not in known]
        if unknown:
            raise ValueError(f"group {i}: unknown parameters {unknown[:4]}; the model has {sorted(known)[:8]}")
        twice = seen.intersection(group)
        if twice:
            raise ValueError(f"group {i}: parameters in more than one group: {sorted(twice)[:4]}")
        seen.update(group)
        out.append((group, lr))
    return out


class TrainingProgram:
    """An ExecuTorch training program with its parameters addressed by the model's own names."""

    def __init__(self, program: bytes, spec: ModelSpec, max_batch: int = DEFAULT_TRAIN_MAX_BATCH) -> None:
        require_executorch()
        from executorch.extension.training import (
            _load_for_executorch_for_training_from_buffer,
            get_sgd_optimizer,
        )

        self._sgd = get_sgd_optimizer
        # the loader does not keep the bytes alive: hold them for the module's lifetime (else segfault)
        self._bytes = bytes(program)
        self._module = _load_for_executorch_for_training_from_buffer(self._bytes)
        self.spec = spec
        self.max_batch = max_batch
        # the runtime exposes parameters only after a first forward/backward
        gen = torch.Generator().manual_seed(0)
        self._module.forward_backward("forward", (sample_input(spec, 1, gen, seq_len=2),
                                                  sample_labels(spec, 1, gen)))
        raw = self._module.named_parameters()
        bad = [k for k in raw if not k.startswith(PARAM_PREFIX)]
        if bad:
            raise ValueError(f"training program parameters are not under {PARAM_PREFIX!r}: {bad[:4]}")
        self._raw_names = {k[len(PARAM_PREFIX):]: k for k in raw}
        self._params = {k[len(PARAM_PREFIX):]: v for k, v in raw.items()}  # alias the program's weights

    @classmethod
    def for_spec(cls, spec: ModelSpec, max_batch: int = DEFAULT_TRAIN_MAX_BATCH) -> TrainingProgram:
        """Export the training program of ``spec``'s model (in a child process: :func:`export_isolated`)
        and load it (raises UnsupportedModel)."""
        return cls(export_isolated(spec, max_batch), spec, max_batch)

    @property
    def program_bytes(self) -> bytes:
        return self._bytes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._params)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` (exactly the model's parameters, float32) into the program's weights."""
        missing = sorted(set(self._params) - set(state))
        extra = sorted(set(state) - set(self._params))
        if missing or extra:
            raise ValueError(f"state does not match the training program: missing {missing[:4]}, extra {extra[:4]}")
        for name, param in self._params.items():
            value = state[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(param.shape)}")
            if not value.is_floating_point():
                raise ValueError(f"{name}: expected a floating-point tensor, got {value.dtype}")
            param.copy_(value.detach().to(param.dtype))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._params.items()}

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """Mean cross-entropy of the batch and the gradient of every parameter (copies)."""
        if x.shape[0] != y.shape[0] or x.shape[0] < 1:
            raise ValueError(f"batch of {x.shape[0]} inputs and {y.shape[0]} labels")
        if x.shape[0] > self.max_batch:
            raise ValueError(f"batch of {x.shape[0]} exceeds the training program's bound {self.max_batch}")
        loss = self._module.forward_backward("forward", (x.contiguous(), y.to(torch.int64).contiguous()))[0]
        grads = self._module.named_gradients()
        return float(loss), {k: grads[raw] for k, raw in self._raw_names.items()}

    def optimizers(self, groups: Sequence[Group]) -> list[tuple[object, list[str]]]:
        """One ExecuTorch SGD optimizer per non-empty group, over the program's own weights."""
        out = []
        for names, lr in validate_groups(groups, self._params):
            if names:
                opt = self._sgd({self._raw_names[n]: self._params[n] for n in names}, lr, 0, 0, 0, False)
                out.append((opt, names))
        return out

    def step(self, optimizers: Sequence[tuple[object, list[str]]], grads: Mapping[str, torch.Tensor]) -> None:
        """One SGD step of every optimizer (from :meth:`optimizers`) with ``grads`` by parameter name."""
        for opt, names in optimizers:
            opt.step({self._raw_names[n]: grads[n] for n in names})  # type: ignore[attr-defined]

    def weight(self, name: str) -> torch.Tensor:
        """The program's current value of parameter ``name`` (a view: copy it to keep it)."""
        return self._params[name]

    def local_round(self, state: Mapping[str, torch.Tensor], batches: Iterable[Batch], groups: Sequence[Group],
                    steps: int | None = None, before_step: BeforeStep | None = None) -> RoundResult:
        """Load ``state``, run SGD over ``batches`` (at most ``steps`` of them), return the new state.

        Per step: forward/backward, ``before_step`` (may replace the groups), then one SGD step per group
        with that group's learning rate: p <- p - lr * grad.
        """
        if steps is not None and steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.load_state(state)
        optimizers = self.optimizers(groups)
        total, count, done = 0.0, 0, 0
        losses: list[float] = []
        for x, y in batches:
            if steps is not None and done >= steps:
                break
            loss, grads = self.forward_backward(x, y)
            if before_step is not None:
                new_groups = before_step(done, grads)
                if new_groups is not None:
                    optimizers = self.optimizers(new_groups)
            self.step(optimizers, grads)
            losses.append(loss)
            total += loss * int(y.shape[0])
            count += int(y.shape[0])
            done += 1
        return RoundResult(self.state(), total / max(1, count), done, count, tuple(losses))


def torch_round(model: nn.Module, state: Mapping[str, torch.Tensor], batches: Iterable[Batch],
                groups: Sequence[Group], steps: int | None = None,
                before_step: BeforeStep | None = None) -> RoundResult:
    """The same round in torch (``torch.optim.SGD`` with one param group per group): the reference."""
    model.load_state_dict(dict(state))
    model.train()
    named = dict(model.named_parameters())

    def make(gs: Sequence[Group]) -> torch.optim.Optimizer | None:
        valid = [(n, lr) for n, lr in validate_groups(gs, named) if n]
        if not valid:
            return None
        return torch.optim.SGD([{"params": [named[n] for n in ns], "lr": lr} for ns, lr in valid], lr=valid[0][1])

    opt = make(groups)
    total, count, done = 0.0, 0, 0
    losses: list[float] = []
    for x, y in batches:
        if steps is not None and done >= steps:
            break
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if before_step is not None:
            grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in named.items()}
            new_groups = before_step(done, grads)
            if new_groups is not None:
                opt = make(new_groups)
        if opt is not None:
            opt.step()
        losses.append(float(loss.detach()))
        total += losses[-1] * int(y.shape[0])
        count += int(y.shape[0])
        done += 1
    return RoundResult({k: v.detach().clone() for k, v in named.items()}, total / max(1, count), done, count,
                       tuple(losses))
