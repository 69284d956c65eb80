"""Client data, mini-batches, local SGD and evaluation: the loops every strategy shares.

Images stay uint8 until a batch is drawn, then are scaled to [0, 1] and normalised; text batches
are int64 token ids. Shuffling draws from a ``torch.Generator`` passed in, so a client's round is
reproducible from its seed on any machine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .data.base import Dataset
from .partition import ClientSplit

__all__ = [
    "Batch",
    "ClientData",
    "Split",
    "TrainingEngine",
    "batches",
    "client_data",
    "current_engine",
    "evaluate",
    "pick_device",
    "sgd_epochs",
    "training_engine",
]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Split:
    x: torch.Tensor  # uint8 images (N, C, H, W) or int64 tokens (N, T), on the CPU
    y: torch.Tensor  # int64 labels (N,)
    mean: torch.Tensor | None  # per-channel normalisation (images only)
    std: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: torch.Tensor) -> Split:
        return Split(self.x[idx], self.y[idx], self.mean, self.std)

    def prepare(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.mean is None or self.std is None:
            return x.to(device)
        x = x.to(device, torch.float32).div_(255.0)
        return x.sub_(self.mean.to(device)).div_(self.std.to(device))


@dataclass(frozen=True)
class ClientData:
    """One client's share: train (for local training), val (hold-out for A_l), test (evaluation)."""

    train: Split
    val: Split
    test: Split

    @property
    def num_train(self) -> int:
        return len(self.train)


def client_data(dataset: Dataset, split: ClientSplit) -> ClientData:
    if dataset.is_text:
        mean = std = None
    else:
        mean = torch.tensor(dataset.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(dataset.std, dtype=torch.float32).view(1, -1, 1, 1)

    def part(idx: np.ndarray) -> Split:
        return Split(torch.from_numpy(np.ascontiguousarray(dataset.x[idx])),
                     torch.from_numpy(dataset.y[idx].astype(np.int64)), mean, std)

    return ClientData(part(split.train), part(split.val), part(split.test))


def batches(split: Split, batch_size: int, device: torch.device, generator: torch.Generator | None = None,
            shuffle: bool = True, drop_last: bool = False) -> Iterator[Batch]:
    """Mini-batches of ``split`` on ``device``; shuffled with ``generator`` when ``shuffle``.

    ``drop_last`` skips a final incomplete batch when there is at least one full batch (PFLlib's
    training loaders do the same: a batch of 1-2 samples through BatchNorm can blow up a ResNet).
    """
    n = len(split)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last and n >= batch_size else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        yield split.prepare(split.x[idx], device), split.y[idx].to(device)


class TrainingEngine(Protocol):
    """Runs :func:`sgd_epochs` somewhere other than torch (e.g. an ExecuTorch training program,
    :class:`export.et_engine.ExecuTorchEngine`), with the same arguments and the same meaning: the
    batches of :func:`batches` in the same order, ``before_step`` after each backward with the
    gradients in the parameters' ``.grad``, one SGD step per parameter group of ``optimizer`` at
    that group's current learning rate, and the model's parameters updated in place at the end."""

    def sgd_epochs(self, model: nn.Module, split: Split, optimizer: torch.optim.Optimizer, epochs: int,
                   batch_size: int, device: torch.device, generator: torch.Generator,
                   before_step: Callable[[int, int], None] | None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> float: ...


_engine = threading.local()


def current_engine() -> TrainingEngine | None:
    """The engine :func:`sgd_epochs` runs on in this thread (None: torch)."""
    return getattr(_engine, "engine", None)


@contextlib.contextmanager
def training_engine(engine: TrainingEngine | None) -> Iterator[None]:
    """Within the block, :func:`sgd_epochs` in this thread runs on ``engine`` (None: torch)."""
    previous = current_engine()
    _engine.engine = engine
    try:
        yield
    finally:
        _engine.engine = previous


def sgd_epochs(model: nn.Module, split: Split, optimizer: torch.optim.Optimizer, epochs: int, batch_size: int,
               device: torch.device, generator: torch.Generator,
               before_step: Callable[[int, int], None] | None = None,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> float:
    """Plain local training; returns the mean training loss.

    ``before_step(epoch, step)`` runs after backward and before ``optimizer.step()`` (where FLAYER's
    per-layer learning rates read the gradients). ``loss_fn(logits, y)`` replaces cross-entropy
    (e.g. Ditto's proximal term adds to it). Runs on this thread's :func:`training_engine` when one
    is set.
    """
    engine = current_engine()
    if engine is not None:
        return engine.sgd_epochs(model, split, optimizer, epochs, batch_size, device, generator, before_step, loss_fn)
    model.train()
    total, count = 0.0, 0
    for epoch in range(epochs):
        for step, (x, y) in enumerate(batches(split, batch_size, device, generator, drop_last=True)):
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y) if loss_fn is None else loss_fn(logits, y)
            loss.backward()
            if before_step is not None:
                before_step(epoch, step)
            optimizer.step()
            total += float(loss.detach()) * y.shape[0]
            count += int(y.shape[0])
    return total / max(1, count)


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, device: torch.device, batch_size: int = 256) -> tuple[int, int, float]:
    """(correct, total, summed cross-entropy) of ``model`` on ``split``."""
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for x, y in batches(split, batch_size, device, shuffle=False):
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return correct, len(split), loss


def pick_device(requested: str = "auto") -> torch.device:
    """``auto``: CUDA if available, else Apple MPS, else CPU; anything else is taken as given."""
    if requested != "auto":
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} requested but CUDA is not available")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"device {requested!r} requested but MPS is not available")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def param_groups_by_lr(model: nn.Module, lrs: Sequence[tuple[Sequence[str], float]]) -> list[dict]:
    """Optimizer parameter groups: each (tensor names, lr) becomes one group."""
    named = dict(model.named_parameters())
    return [{"params": [named[n] for n in names], "lr": lr, "names": list(names)} for names, lr in lrs]
