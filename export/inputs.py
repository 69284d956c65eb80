"""Sample inputs and dynamic shapes for the models of :mod:`flayer.models`.

Images: float32 (batch, C, H, W) drawn from a standard normal (the range normalised images have).
Text (fastText): int64 token ids (batch, length) in [1, vocab), with trailing padding (id 0) on
every other row so the padding mask is exercised. The batch dimension is dynamic in every export.
"""

from __future__ import annotations

from typing import Any

import torch

from flayer.models import ModelSpec

__all__ = ["DEFAULT_SEQ_LEN", "batch_dim", "dynamic_shapes", "input_name", "sample_input", "sample_labels"]

DEFAULT_SEQ_LEN = 200  # PFLlib's text length for AG News


def input_name(spec: ModelSpec) -> str:
    return "tokens" if spec.is_text else "images"


def sample_input(spec: ModelSpec, batch: int, generator: torch.Generator,
                 seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """A batch of inputs ``spec``'s model accepts, drawn from ``generator``."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if spec.is_text:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        tokens = torch.randint(1, spec.vocab_size, (batch, seq_len), generator=generator, dtype=torch.int64)
        for row in range(1, batch, 2):
            keep = int(torch.randint(1, seq_len + 1, (1,), generator=generator))
            tokens[row, keep:] = 0
        return tokens
    return torch.randn(batch, spec.in_channels, spec.height, spec.width, generator=generator)


def sample_labels(spec: ModelSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, spec.num_classes, (batch,), generator=generator, dtype=torch.int64)


def batch_dim(max_batch: int | None = None) -> Any:
    """The dynamic batch dimension for ``torch.export`` (bounded when ``max_batch`` is given: ExecuTorch
    plans its memory for the upper bound)."""
    from torch.export import Dim

    if max_batch is None:
        return Dim("batch", min=1)
    if max_batch < 2:
        raise ValueError(f"max_batch must be >= 2, got {max_batch}")
    return Dim("batch", min=1, max=max_batch)


def dynamic_shapes(spec: ModelSpec, max_batch: int | None = None, max_len: int | None = None) -> tuple[Any, ...]:
    """``dynamic_shapes`` for exporting ``spec``'s model with one positional input: the batch is dynamic,
    and so is the text length for fastText."""
    from torch.export import Dim

    dims = {0: batch_dim(max_batch)}
    if spec.is_text:
        dims[1] = Dim("length", min=1) if max_len is None else Dim("length", min=1, max=max_len)
    return (dims,)
