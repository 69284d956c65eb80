"""ExecuTorch ``.pte`` export (``to_edge_transform_and_lower`` + XNNPACK partitioner) and a runner
built on ``executorch.runtime``.

The batch dimension is dynamic up to ``max_batch``: ExecuTorch plans its memory for the upper bound.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from flayer.models import ModelSpec
from flayer.state import atomic_write

from .deps import require_executorch
from .inputs import DEFAULT_SEQ_LEN, dynamic_shapes
from .verify import Runner

__all__ = ["DEFAULT_MAX_BATCH", "export_pte", "pte_runner", "set_executorch_threads"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64


def export_pte(model: nn.Module, spec: ModelSpec, sample: torch.Tensor, path: str | Path,
               max_batch: int = DEFAULT_MAX_BATCH, max_len: int = DEFAULT_SEQ_LEN) -> Path:
    """Lower ``model`` (eval mode) to ExecuTorch with XNNPACK and write the program to ``path``."""
    require_executorch()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model.eval()
    if int(sample.shape[0]) > max_batch:
        raise ValueError(f"sample batch {int(sample.shape[0])} exceeds max_batch {max_batch}")
    program = torch.export.export(model, (sample,), dynamic_shapes=dynamic_shapes(spec, max_batch, max_len))
    lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    path = atomic_write(path, lowered.buffer)
    log.info("wrote %s (%d bytes)", path, path.stat().st_size)
    return path


def set_executorch_threads(threads: int) -> None:
    """Size ExecuTorch's CPU thread pool (used by XNNPACK); 0 leaves it as it is."""
    if threads <= 0:
        return
    require_executorch()
    from executorch.extension.pybindings import portable_lib

    reset = getattr(portable_lib, "_unsafe_reset_threadpool", None)
    if reset is not None:
        reset(threads)


def pte_runner(path: str | Path) -> Runner:
    """Run the ``forward`` method of the ``.pte`` at ``path`` with the ExecuTorch runtime."""
    require_executorch()
    from executorch.runtime import Runtime

    data = Path(path).read_bytes()
    program = Runtime.get().load_program(data)  # the Program object holds the bytes alive
    method = program.load_method("forward")
    if method is None:
        raise ValueError(f"{path}: the program has no 'forward' method")

    def run(x: torch.Tensor) -> torch.Tensor:
        return method.execute([x.contiguous()])[0]

    run.program = program  # type: ignore[attr-defined]  # keep the program (and its bytes) alive
    return run
