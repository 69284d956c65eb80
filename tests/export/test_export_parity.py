"""ONNX (onnxruntime) and ExecuTorch .pte (XNNPACK) give torch's logits within 1e-4, at batch 1 and
at a larger batch (the batch dimension is dynamic)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from export.inputs import sample_input
from export.verify import NonFiniteModel, latency_ms, max_abs_diff, parity, torch_runner
from flayer.models import ModelSpec, build_model

needs_onnx = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxruntime", "onnxscript")),
                                reason="needs the 'export' extra")
needs_executorch = pytest.mark.skipif(importlib.util.find_spec("executorch") is None,
                                      reason="needs the 'executorch' extra")

TOL = 1e-4

CNN = ModelSpec("cnn", in_channels=1, height=28, width=28, num_classes=10)
RESNET = ModelSpec("resnet18", in_channels=3, height=32, width=32, num_classes=10)
FASTTEXT = ModelSpec("fasttext", num_classes=4, vocab_size=500, hidden_dim=32)


def _model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(spec)
    if spec.name == "resnet18":
        # non-trivial BatchNorm statistics, as a trained model has
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d) and m.running_mean is not None and m.running_var is not None:
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def _inputs(spec: ModelSpec, seq_len: int = 40) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    sample = sample_input(spec, 2, gen, seq_len)
    return sample, [sample_input(spec, 1, gen, seq_len), sample_input(spec, 7, gen, seq_len)]


def _check_onnx(spec, tmp_path):
    from export.onnx_export import export_onnx, onnx_runner

    model = _model(spec)
    sample, inputs = _inputs(spec)
    path = export_onnx(model, spec, sample, tmp_path / "m.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # one self-contained file
    result = parity(torch_runner(model), onnx_runner(path, threads=1), inputs, TOL)
    assert result.batches == (1, 7)
    assert result.ok, result
    return model, path


@needs_onnx
@pytest.mark.parametrize("spec", [CNN, RESNET, FASTTEXT], ids=["cnn", "resnet18", "fasttext"])
def test_onnx_parity(spec, tmp_path):
    model, path = _check_onnx(spec, tmp_path)
    size = path.stat().st_size
    params = sum(p.numel() for p in model.parameters())
    assert 4 * params <= size <= 4 * params * 1.1 + 100_000  # float32 weights inside the file


@needs_onnx
def test_onnx_loads_from_bytes(tmp_path):
    import onnxruntime as ort

    model, path = _check_onnx(CNN, tmp_path)
    session = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 1, 28, 28)
    out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    assert max_abs_diff(out, torch_runner(model)(x)) <= TOL


def _check_pte(spec, tmp_path):
    from export.pte_export import export_pte, pte_runner

    model = _model(spec)
    sample, inputs = _inputs(spec)
    path = export_pte(model, spec, sample, tmp_path / "m.pte", max_batch=16, max_len=40)
    run = pte_runner(path)
    result = parity(torch_runner(model), run, inputs, TOL)
    assert result.ok, result
    return model, path, run


# the cnn is slow (~11 s of CPU): tests/export/test_export_cli.py::test_export_personal_model exports a cnn to
# .pte through the same export_pte and checks its parity at two batch sizes in the default run
@needs_executorch
@pytest.mark.parametrize("spec", [pytest.param(CNN, id="cnn", marks=pytest.mark.slow),
                                  pytest.param(FASTTEXT, id="fasttext")])
def test_pte_parity(spec, tmp_path):
    _check_pte(spec, tmp_path)


@needs_executorch
@pytest.mark.slow
def test_pte_parity_resnet18(tmp_path):
    _check_pte(RESNET, tmp_path)


@needs_executorch
def test_pte_rejects_batch_above_bound(tmp_path):
    from export.pte_export import export_pte

    model = _model(CNN)
    with pytest.raises(ValueError, match="max_batch"):
        export_pte(model, CNN, torch.randn(20, 1, 28, 28), tmp_path / "m.pte", max_batch=16)


def test_parity_flags_a_wrong_runtime():
    model = _model(CNN)
    ref = torch_runner(model)
    inputs = [torch.randn(2, 1, 28, 28)]
    assert parity(ref, lambda x: ref(x) + 1e-3, inputs, TOL).max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert not parity(ref, lambda x: ref(x) + 1e-3, inputs, TOL).ok
    assert not parity(ref, lambda x: ref(x) * float("nan"), inputs, TOL).ok
    with pytest.raises(ValueError, match="shapes differ"):
        parity(ref, lambda x: ref(x)[:, :5], inputs, TOL)
    with pytest.raises(NonFiniteModel, match="not finite"):
        parity(lambda x: ref(x) / 0.0, ref, inputs, TOL)


def test_latency_is_per_sample():
    calls: list[torch.Tensor] = []

    def run(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return x

    ms = latency_ms(run, torch.zeros(4, 1), repeats=3, warmup=1)
    assert len(calls) == 4 and ms >= 0
