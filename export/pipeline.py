"""The ``flayer export`` job for one saved model: write each format, check parity, time it.

Each file is verified on sample inputs (a batch of 1 and a batch of ``batch``) against torch eager;
a file whose max abs difference exceeds the tolerance is renamed ``*.rejected`` and reported as
failed. Latency is per sample at batch 1 (median of ``repeats`` calls), measured side by side with
torch eager in the same process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flayer.models import ModelSpec

from .inputs import DEFAULT_SEQ_LEN, sample_input, sample_labels
from .verify import Parity, Runner, check_finite, latency_ms, parity, torch_runner

__all__ = ["FORMATS", "ExportOptions", "ExportReport", "FormatResult", "export_model"]

log = logging.getLogger(__name__)

FORMATS = ("onnx", "pte")


@dataclass(frozen=True)
class ExportOptions:
    formats: tuple[str, ...] = FORMATS
    batch: int = 8  # the larger parity batch (a batch of 1 is always checked too)
    seq_len: int = DEFAULT_SEQ_LEN  # fastText sample length
    max_batch: int = 64  # upper bound of the .pte's dynamic batch
    tolerance: float = 1e-4
    repeats: int = 50
    threads: int = 0  # onnxruntime / ExecuTorch threads (0 = torch's current count)
    seed: int = 0
    training_program: bool = False  # also write the ExecuTorch training program (cnn, fasttext)

    def __post_init__(self) -> None:
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise ValueError(f"formats must be a non-empty subset of {', '.join(FORMATS)}, got {self.formats}")
        if not 1 <= self.batch <= self.max_batch:
            raise ValueError(f"batch must be in [1, max_batch={self.max_batch}], got {self.batch}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


@dataclass(frozen=True)
class FormatResult:
    format: str  # onnx | pte | train-pte
    path: Path
    bytes: int
    max_abs_diff: float
    tolerance: float
    latency_ms: float | None  # per sample, batch 1 (None for the training program)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.format, "path": str(self.path), "bytes": self.bytes, "max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance, "ok": self.ok, "latency_ms_per_sample": self.latency_ms, **self.detail}


@dataclass(frozen=True)
class ExportReport:
    spec: ModelSpec
    torch_latency_ms: float
    results: tuple[FormatResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


def _finish(fmt: str, path: Path, run: Runner, reference: Runner, inputs: list[torch.Tensor],
            opts: ExportOptions) -> FormatResult:
    check: Parity = parity(reference, run, inputs, opts.tolerance)
    lat = latency_ms(run, inputs[0], opts.repeats)
    size = path.stat().st_size
    if not check.ok:
        rejected = path.with_name(path.name + ".rejected")
        path.replace(rejected)
        log.error("%s: max abs difference %.3g exceeds %.3g; renamed to %s", path, check.max_abs_diff,
                  opts.tolerance, rejected)
        path = rejected
    return FormatResult(fmt, path, size, check.max_abs_diff, opts.tolerance, lat,
                        {"parity_batches": list(check.batches)})


def _training_program(model: nn.Module, spec: ModelSpec, path: Path, opts: ExportOptions) -> FormatResult:
    """Write the training program and check 3 SGD steps against torch (loss, gradients, parameters)."""
    from flayer.state import atomic_write

    from .et_round import TrainingProgram, torch_round
    from .et_training import check_training_support, export_training_program, training_model

    check_training_support(spec)
    train_model = training_model(spec)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train_model.load_state_dict(state)
    program = TrainingProgram(export_training_program(train_model, spec, opts.max_batch, opts.seq_len), spec,
                              opts.max_batch)
    gen = torch.Generator().manual_seed(opts.seed + 1)
    batches = [(sample_input(spec, opts.batch, gen, opts.seq_len), sample_labels(spec, opts.batch, gen))
               for _ in range(3)]
    groups = [(list(state), 0.01)]
    et = program.local_round(state, batches, groups)
    ref = torch_round(train_model, state, batches, groups)
    diff = max(abs(et.mean_loss - ref.mean_loss), *((et.state[k] - ref.state[k]).abs().max().item() for k in state))
    atomic_write(path, program.program_bytes)
    result = FormatResult("train-pte", path, path.stat().st_size, diff, opts.tolerance, None,
                          {"parity": "loss and parameters after 3 SGD steps (lr 0.01)"})
    if not result.ok:
        rejected = path.with_name(path.name + ".rejected")
        path.replace(rejected)
        return FormatResult("train-pte", rejected, result.bytes, diff, opts.tolerance, None, result.detail)
    return result


def export_model(model: nn.Module, spec: ModelSpec, out_dir: str | Path, stem: str, opts: ExportOptions,
                 on_progress: Callable[[str], None] | None = None) -> ExportReport:
    """Export ``model`` to every format of ``opts`` under ``out_dir`` as ``<stem>.<ext>``.

    Raises :class:`export.verify.NonFiniteModel` when the model's own outputs are not finite.
    """
    out = Path(out_dir)
    note = on_progress or (lambda _msg: None)
    threads = opts.threads or torch.get_num_threads()
    model.eval()
    gen = torch.Generator().manual_seed(opts.seed)
    sample = sample_input(spec, 2, gen, opts.seq_len)
    inputs = [sample_input(spec, 1, gen, opts.seq_len), sample_input(spec, opts.batch, gen, opts.seq_len)]
    reference = torch_runner(model)
    check_finite(reference, inputs)  # raises NonFiniteModel before anything is written
    out.mkdir(parents=True, exist_ok=True)
    torch_ms = latency_ms(reference, inputs[0], opts.repeats)
    results = []
    if "onnx" in opts.formats:
        from .onnx_export import export_onnx, onnx_runner

        note("exporting ONNX")
        path = export_onnx(model, spec, sample, out / f"{stem}.onnx")
        results.append(_finish("onnx", path, onnx_runner(path, threads), reference, inputs, opts))
    if "pte" in opts.formats:
        from .pte_export import export_pte, pte_runner, set_executorch_threads

        note("exporting ExecuTorch (XNNPACK)")
        path = export_pte(model, spec, sample, out / f"{stem}.pte", opts.max_batch, max(opts.seq_len, 2))
        set_executorch_threads(threads)
        results.append(_finish("pte", path, pte_runner(path), reference, inputs, opts))
    if opts.training_program:
        note("exporting the ExecuTorch training program")
        results.append(_training_program(model, spec, out / f"{stem}.train.pte", opts))
    return ExportReport(spec, torch_ms, tuple(results))
