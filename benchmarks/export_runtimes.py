"""Export and on-device runtimes, measured side by side in one run.

1. Inference: FedAvgCNN (Fashion-MNIST 1x28x28 and CIFAR-shaped 3x32x32) and ResNet-18 (3x32x32) to
   ONNX and ExecuTorch .pte: file sizes, max abs difference to torch (batch 1 and 8), latency per
   sample at batch 1 for torch eager, onnxruntime and ExecuTorch (XNNPACK).
2. Training through an ExecuTorch training program: FedAvgCNN (reshape pool) on real Fashion-MNIST
   batches with per-layer learning rates, and fastText; max abs difference of the loss, the gradients
   (every step) and the parameters after N steps, and time per step against torch. Then FedAvgCNN with
   torch's max_pool2d, the case that is refused: the same differences.

    python benchmarks/export_runtimes.py [--steps 20] [--threads 2] [--repeats 50]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.report import table
from export.inputs import sample_input, sample_labels
from export.pipeline import ExportOptions, export_model
from flayer.models import FedAvgCNN, ModelSpec, build_model


def _model(spec: ModelSpec) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(spec)
    with torch.no_grad():  # BatchNorm statistics like a trained model's
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d) and m.running_mean is not None and m.running_var is not None:
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def inference(repeats: int, threads: int) -> None:
    specs = [("FedAvgCNN 1x28x28", ModelSpec("cnn", 1, 28, 28, 10)),
             ("FedAvgCNN 3x32x32", ModelSpec("cnn", 3, 32, 32, 10)),
             ("ResNet-18 3x32x32", ModelSpec("resnet18", 3, 32, 32, 10))]
    rows = []
    opts = ExportOptions(repeats=repeats, threads=threads)
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec in specs:
            t0 = time.perf_counter()
            report = export_model(_model(spec), spec, tmp, spec.name, opts)
            seconds = time.perf_counter() - t0
            by = {r.format: r for r in report.results}
            on, pte = by["onnx"], by["pte"]
            rows.append((label, f"{on.bytes / 1e6:.2f}", f"{pte.bytes / 1e6:.2f}", f"{on.max_abs_diff:.1e}",
                         f"{pte.max_abs_diff:.1e}", f"{report.torch_latency_ms:.3f}", f"{on.latency_ms:.3f}",
                         f"{pte.latency_ms:.3f}", f"{seconds:.0f}"))
    print(f"\nInference export (threads {threads}; latency = median ms per sample at batch 1, {repeats} calls)")
    print(table(["model", "onnx MB", "pte MB", "onnx |diff|", "pte |diff|", "torch ms", "onnxruntime ms",
                 "executorch ms", "export+check s"], rows, markdown=True))


def _fmnist_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from flayer.data import load_dataset

    ds = load_dataset("fmnist")
    mean = torch.tensor(ds.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(ds.std, dtype=torch.float32).view(1, -1, 1, 1)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(ds.y), generator=gen)[: steps * batch]
    x = (torch.from_numpy(ds.x[idx.numpy()]).float() / 255.0 - mean) / std
    y = torch.from_numpy(ds.y[idx.numpy()].astype("int64"))
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)]


def _layer_groups(state: dict[str, torch.Tensor], lrs: list[float]) -> list[tuple[list[str], float]]:
    layers: dict[str, list[str]] = {}
    for name in state:
        layers.setdefault(name.split(".")[0], []).append(name)
    return [(names, lr) for (_, names), lr in zip(layers.items(), lrs)]


def _best_seconds(run, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _compare(label, program, ref_model, state, batches, groups):
    from export.et_round import torch_round

    et_g: list[dict[str, torch.Tensor]] = []
    ref_g: list[dict[str, torch.Tensor]] = []
    et = program.local_round(state, batches, groups,
                             before_step=lambda i, g: et_g.append({k: v.clone() for k, v in g.items()}))
    ref = torch_round(ref_model, state, batches, groups,
                      before_step=lambda i, g: ref_g.append({k: v.clone() for k, v in g.items()}))
    loss_d = max(abs(a - b) for a, b in zip(et.losses, ref.losses))
    grad_d = max(float((a[k] - b[k]).abs().max()) for a, b in zip(et_g, ref_g) for k in a)
    grad_1 = max(float((et_g[0][k] - ref_g[0][k]).abs().max()) for k in et_g[0])
    param_d = max(float((et.state[k] - ref.state[k]).abs().max()) for k in state)
    # speed: the same round, best of 3, each path warmed up above
    et_s = _best_seconds(lambda: program.local_round(state, batches, groups))
    torch_s = _best_seconds(lambda: torch_round(ref_model, state, batches, groups))
    n = len(batches)
    return (label, n, f"{loss_d:.1e}", f"{grad_1:.1e}", f"{grad_d:.1e}", f"{param_d:.1e}",
            f"{1000 * torch_s / n:.1f}", f"{1000 * et_s / n:.1f}", f"{et_s / torch_s:.1f}x")


def training(steps: int) -> None:
    from export.et_round import TrainingProgram
    from export.et_training import lower_training_program, training_model

    rows = []
    spec = ModelSpec("cnn", 1, 28, 28, 10)
    batches = _fmnist_batches(steps, 10)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in build_model(spec).state_dict().items()}
    groups = _layer_groups(state, [0.005, 0.01, 0.02, 0.001])  # per-layer LRs as four SGD groups
    program = TrainingProgram.for_spec(spec, max_batch=32)
    rows.append(_compare("FedAvgCNN, reshape pool (supported)", program, training_model(spec), state, batches,
                         groups))
    text = ModelSpec("fasttext", num_classes=4, vocab_size=20000, hidden_dim=32)
    gen = torch.Generator().manual_seed(1)
    text_batches = [(sample_input(text, 10, gen, 200), sample_labels(text, 10, gen)) for _ in range(steps)]
    torch.manual_seed(1)
    text_state = {k: v.clone() for k, v in build_model(text).state_dict().items()}
    rows.append(_compare("fastText (supported)", TrainingProgram.for_spec(text, max_batch=32), build_model(text),
                         text_state, text_batches, _layer_groups(text_state, [0.1, 0.1, 0.1])))
    torch_pool = FedAvgCNN(1, 10, 1024, pool="torch")
    bad = TrainingProgram(lower_training_program(torch_pool, spec, max_batch=32), spec, max_batch=32)
    rows.append(_compare("FedAvgCNN, torch max_pool2d (refused)", bad, FedAvgCNN(1, 10, 1024, pool="torch"),
                         state, batches, groups))
    print(f"\nTraining through ExecuTorch vs torch ({steps} SGD steps, batch 10, per-layer learning rates; "
          f"max abs differences)")
    print(table(["model", "steps", "loss", "grads step 1", "grads all steps", "params after", "torch ms/step",
                 "executorch ms/step", "slower"], rows, markdown=True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--skip-inference", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)
    for name in ("torch", "torchao", "executorch", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    if not args.skip_inference:
        inference(args.repeats, args.threads)
    training(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
