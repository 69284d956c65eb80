"""ONNX export (``torch.onnx.export``, dynamo exporter, dynamic batch) and an onnxruntime runner.

``external_data=False`` keeps the weights inside the one ``.onnx`` file (the dynamo exporter writes
them to a side file by default), so the file is self-contained and loadable from bytes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from flayer.models import ModelSpec

from .deps import require_onnx
from .inputs import dynamic_shapes, input_name
from .verify import Runner

__all__ = ["export_onnx", "onnx_runner"]

log = logging.getLogger(__name__)


def export_onnx(model: nn.Module, spec: ModelSpec, sample: torch.Tensor, path: str | Path) -> Path:
    """Write ``model`` (in eval mode) to ``path`` as one self-contained ONNX file with a dynamic batch.

    ``sample`` is one input batch of at least 2 rows (a batch of 1 would be specialised).
    """
    mods = require_onnx()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.eval()
    torch.onnx.export(model, (sample,), str(path), dynamo=True, external_data=False,
                      dynamic_shapes=dynamic_shapes(spec), input_names=[input_name(spec)],
                      output_names=["logits"], verbose=False)
    mods["onnx"].checker.check_model(str(path))
    log.info("wrote %s (%d bytes)", path, path.stat().st_size)
    return path


def onnx_runner(path: str | Path, threads: int = 0) -> Runner:
    """Run the ONNX file at ``path`` with onnxruntime on the CPU (``threads`` 0 = onnxruntime's default)."""
    ort = require_onnx()["onnxruntime"]
    options = ort.SessionOptions()
    if threads > 0:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: x.numpy()})[0])

    return run
