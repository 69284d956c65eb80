"""``--runtime executorch``: a strategy's local SGD through the ExecuTorch training program gives the
same federation as torch (same batches, same per-layer learning rates, same frozen parameters), and
what it cannot run is refused with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flayer.config import ConfigError, TrainConfig
from flayer.partition import make_partition
from flayer.simulation import simulate
from flayer.spec import ModelSpec
from flayer.strategies import make_strategy
from flayer.train import client_data, current_engine, sgd_epochs, training_engine

et_engine = pytest.importorskip("export.et_engine")
pytest.importorskip("executorch")

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 2


@pytest.fixture(scope="module")
def fleet(digits: Any) -> tuple[Any, list[Any]]:
    # 600 of the 1,797 images: ExecuTorch's portable kernels are ~80x slower than torch, and the
    # parity checks need steps, not data
    part = make_partition(digits.y, digits.num_classes, 3, "dir0.5", seed=0, samples=600)
    return digits, [client_data(digits, c) for c in part.clients]


@pytest.fixture(scope="module")
def engine(fleet: tuple[Any, list[Any]]) -> Any:
    return et_engine.ExecuTorchEngine(fleet[0].model_spec())


def _run(name: str, fleet: tuple[Any, list[Any]], engine: Any) -> Any:
    ds, clients = fleet
    strategy = make_strategy(name, ds.model_spec(), TrainConfig(lr=0.005, batch_size=10, local_epochs=1), {})
    with training_engine(engine):
        return simulate(strategy, clients, ROUNDS, seed=3)


# flayer covers plain SGD steps, per-layer groups and a frozen body; fedavg and fedbabu add no path of
# their own; all three are slow (~20 s each): the default run keeps FLAYER through ExecuTorch in
# tests/integration/test_federation_executorch.py (an ExecuTorch device beside a torch device)
@pytest.mark.parametrize("name", [pytest.param("fedavg", marks=pytest.mark.slow),
                                  pytest.param("flayer", marks=pytest.mark.slow),
                                  pytest.param("fedbabu", marks=pytest.mark.slow)])
def test_a_federation_through_executorch_matches_torch(name: str, fleet: Any, engine: Any) -> None:
    """fedavg: plain SGD; flayer: Eq. 4's per-layer rates every step and the head-only epoch with the
    body frozen; fedbabu: the head frozen during training and the final fine-tune."""
    steps0 = engine.steps
    ref = _run(name, fleet, None)
    got = _run(name, fleet, engine)
    steps = engine.steps - steps0
    expected = sum(len(c.train) // 10 for c in fleet[1]) * ROUNDS
    assert steps >= expected, f"only {steps} SGD steps went through the program (at least {expected} expected)"
    worst = max(float((got.global_state[k] - ref.global_state[k]).abs().max()) for k in ref.global_state)
    moved = max(float((ref.global_state[k] - v).abs().max()) for k, v in _run_init(name, fleet).items())
    print(f"{name}: {steps} steps through ExecuTorch, max |executorch - torch| = {worst:.3g} (moved {moved:.3g})")
    assert moved > 1e-3
    assert worst <= 1e-4
    assert [r.acc for r in got.rounds] == pytest.approx([r.acc for r in ref.rounds], abs=0.02)


def _run_init(name: str, fleet: Any) -> dict[str, torch.Tensor]:
    from flayer.engine import initial_global_state

    ds = fleet[0]
    return initial_global_state(make_strategy(name, ds.model_spec(), TrainConfig(lr=0.005, batch_size=10), {}), 3)


def test_the_engine_is_per_thread_and_restored(engine: Any) -> None:
    assert current_engine() is None
    with training_engine(engine):
        assert current_engine() is engine
        seen: list[Any] = []
        import threading

        t = threading.Thread(target=lambda: seen.append(current_engine()))
        t.start()
        t.join()
        assert seen == [None]  # another thread (e.g. another emulated device) still trains with torch
    assert current_engine() is None


@pytest.mark.parametrize("name, words", [("ditto", "custom loss"), ("fedala", "autograd")])
def test_strategies_that_cannot_train_through_it_are_refused(name: str, words: str, digits: Any) -> None:
    with pytest.raises(et_engine.UnsupportedTraining, match=words):
        et_engine.check_strategy(name, digits.model_spec())


def test_resnet18_is_refused_with_the_reason() -> None:
    spec = ModelSpec("resnet18", 10, 3, 32, 32)
    with pytest.raises(et_engine.UnsupportedTraining, match="BatchNorm"):
        et_engine.check_strategy("fedavg", spec)
    with pytest.raises(et_engine.UnsupportedTraining, match="BatchNorm"):
        et_engine.ExecuTorchEngine(spec)


def test_momentum_custom_loss_big_batches_and_gpus_are_refused(fleet: Any, engine: Any) -> None:
    ds, clients = fleet
    model = make_strategy("fedavg", ds.model_spec(), TrainConfig(), {}).new_model()
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    cases = [
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 10, cpu, None, "momentum"),
        (torch.optim.Adam(model.parameters()), 10, cpu, None, "plain SGD"),
        (torch.optim.SGD(model.parameters(), lr=0.1), 10, cpu, lambda z, y: z.sum(), "custom loss"),
        (torch.optim.SGD(model.parameters(), lr=0.1), engine.max_batch + 1, cpu, None, "bound"),
        (torch.optim.SGD(model.parameters(), lr=0.1), 10, torch.device("cuda"), None, "CPU"),
    ]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for opt, batch, device, loss_fn, words in cases:
        with training_engine(engine), pytest.raises(et_engine.UnsupportedTraining, match=words):
            sgd_epochs(model, clients[0].train, opt, 1, batch, device, gen, loss_fn=loss_fn)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a refused run changed the model"


def test_edge_settings_validate_the_runtime() -> None:
    from edge_client.config import EdgeSettings

    assert EdgeSettings(runtime="executorch").runtime == "executorch"
    with pytest.raises(ConfigError, match="runtime"):
        EdgeSettings(runtime="onnx")
    with pytest.raises(ConfigError, match="CPU"):
        EdgeSettings(runtime="executorch", device="cuda")


def _simulate_cli(tmp_path: Path, strategy: str, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cli.main", "simulate", "--dataset", "digits", "--partition", "iid", "--clients",
           "2", "--samples", "300", "--rounds", "1", "--threads", "1", "--runtime", "executorch", "--strategy",
           strategy, "--out", str(tmp_path / strategy)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False, text=True, timeout=timeout)


def test_simulate_cli_refuses_what_executorch_cannot_train(tmp_path: Path) -> None:
    bad = _simulate_cli(tmp_path, "ditto", 120)
    assert bad.returncode != 0 and "ditto" in bad.stderr and "custom loss" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.slow  # the same engine runs in-process above; this adds the CLI's wiring of --runtime
def test_simulate_cli_runtime_flag(tmp_path: Path) -> None:
    ok = _simulate_cli(tmp_path, "fedavg", 300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "SGD steps through ExecuTorch" in ok.stdout
