"""``flayer export`` on personal models written by a short ``flayer simulate --save-models`` run."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from cli.main import main
from flayer.models import ModelSpec, build_model
from flayer.state import load_model, save_model
from flayer.update import float_state

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxruntime", "onnxscript", "executorch")),
    reason="needs the 'export' and 'executorch' extras")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    rc = main(["simulate", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--strategy", "fedavg",
               "--seed", "1", "--save-models", "--out", str(out)])
    assert rc == 0
    return out / "models"


def test_export_personal_model(simulated, tmp_path, capsys):
    import onnxruntime as ort
    from executorch.runtime import Runtime

    state = simulated / "client_001.safetensors"
    out = tmp_path / "export"
    rc = main(["export", "--state", str(state), "--format", "all", "--out", str(out), "--repeats", "2",
               "--training-program"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "max |diff|" in captured.out and "torch eager" in captured.out
    summary = json.loads((out / "client_001.export.json").read_text())
    assert [r["format"] for r in summary["results"]] == ["onnx", "pte", "train-pte"]
    for r in summary["results"]:
        assert r["ok"] and r["max_abs_diff"] <= 1e-4
        assert r["bytes"] == (out / r["path"].split("/")[-1]).stat().st_size

    # the exported files reproduce the saved personal model
    model, spec, meta = load_model(state)
    assert meta["role"] == "personal" and spec.height == 16
    model.eval()
    x = torch.randn(5, 1, 16, 16)
    with torch.no_grad():
        expected = model(x)
    session = ort.InferenceSession(str(out / "client_001.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    assert (got - expected).abs().max() <= 1e-4
    method = Runtime.get().load_program(out / "client_001.pte").load_method("forward")
    assert (method.execute([x])[0] - expected).abs().max() <= 1e-4
    with torch.no_grad():  # the exported weights are the trained ones, not a fresh initialisation
        assert (build_model(spec).eval()(x) - expected).abs().max() > 1e-3


def test_training_program_refused_for_resnet(tmp_path, capsys):
    torch.manual_seed(0)
    spec = ModelSpec("resnet18", in_channels=3, height=32, width=32, num_classes=10)
    path = save_model(tmp_path / "resnet.safetensors", float_state(build_model(spec)), spec)
    rc = main(["export", "--state", str(path), "--format", "onnx", "--training-program", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--training-program: ResNet-18 cannot train through ExecuTorch" in err


@pytest.mark.parametrize("args,message", [
    (["--state", "{tmp}/nope.safetensors"], "does not exist"),
    (["--state", "{tmp}/bad.safetensors"], "not a readable safetensors file"),
    (["--state", "{tmp}/nope.safetensors", "--batch", "0"], "batch must be in"),
    (["--state", "{tmp}/nope.safetensors", "--tolerance", "0"], "tolerance must be > 0"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    (tmp_path / "bad.safetensors").write_bytes(b"not a model")
    argv = ["export", "--out", str(tmp_path / "o")] + [a.format(tmp=tmp_path) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def _cnn_file(tmp_path, corrupt: bool = False):
    torch.manual_seed(0)
    spec = ModelSpec("cnn", in_channels=1, height=16, width=16, num_classes=10)
    state = float_state(build_model(spec))
    if corrupt:
        state["fc.bias"][3] = float("inf")
    return save_model(tmp_path / "cnn.safetensors", state, spec)


def test_diverged_model_is_refused_before_writing(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["export", "--state", str(_cnn_file(tmp_path, corrupt=True)), "--format", "onnx", "--out", str(out)])
    assert rc == 2
    assert "outputs are not finite" in capsys.readouterr().err
    assert not out.exists()


def test_parity_failure_rejects_the_file(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["export", "--state", str(_cnn_file(tmp_path)), "--format", "onnx", "--out", str(out),
               "--tolerance", "1e-12", "--repeats", "1"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "parity above 1e-12 for onnx" in captured.err
    assert (out / "cnn.onnx.rejected").is_file() and not (out / "cnn.onnx").exists()
    summary = json.loads((out / "cnn.export.json").read_text())
    assert summary["results"][0]["ok"] is False and summary["results"][0]["max_abs_diff"] > 1e-12
