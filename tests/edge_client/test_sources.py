"""A device's own data and the federation's own model: each wrong input is one clear error (naming the
path, what was expected and what was found), and nothing is written."""

from __future__ import annotations

import dataclasses
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_client.sources import SourceConfig, check_source, load_source
from flayer.config import TrainConfig
from flayer.data import DataError
from flayer.registry import build_model, with_fingerprint
from flayer.spec import ModelSpec, canonical_args, canonical_classes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fleetlib import CLASSES, write_images

SIZE = 8


def spec(width: int = 8, **kw: object) -> ModelSpec:
    base = ModelSpec("fleetmodel:build", in_channels=3, height=SIZE, width=SIZE, num_classes=3,
                     args=canonical_args({"size": SIZE, "width": width}), classes=canonical_classes(CLASSES))
    return with_fingerprint(dataclasses.replace(base, **kw))  # type: ignore[arg-type]


def files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_folder_source_splits_by_seed_and_maps_class_names(tmp_path: Path) -> None:
    write_images(tmp_path / "img", {"owl": 7, "cat": 5}, SIZE)
    cfg = SourceConfig("folder", str(tmp_path / "img"), val_fraction=0.2, test_fraction=0.25, seed=3)
    a, b = load_source(cfg, spec()), load_source(cfg, spec())
    assert (len(a.train), len(a.val), len(a.test)) == (7, 2, 3)
    assert torch.equal(a.train.y, b.train.y) and torch.equal(a.test.x, b.test.x)  # seeded
    assert sorted(torch.cat([a.train.y, a.val.y, a.test.y]).tolist()) == [0] * 5 + [2] * 7  # cat = 0, owl = 2
    assert a.train.x.dtype == torch.uint8 and tuple(a.train.x.shape[1:]) == (3, SIZE, SIZE)


def test_resize_fits_other_sizes_and_modes(tmp_path: Path) -> None:
    write_images(tmp_path / "img", {"dog": 4}, 13, mode="L")
    data = load_source(SourceConfig("folder", str(tmp_path / "img"), resize=True), spec())
    assert tuple(data.train.x.shape[1:]) == (3, SIZE, SIZE)


@pytest.mark.parametrize("case, message", [
    ("empty", "empty"),
    ("unknown class", "class folder(s) ['zebra'] are not in the federation's classes ['cat', 'dog', 'owl']"),
    ("wrong size", "expected 8x8 RGB (the model's input), found 12x12 RGB"),
    ("wrong mode", "expected 8x8 RGB (the model's input), found 8x8 L"),
    ("stray file", "expected only class folders, found file 'notes.txt'"),
])
def test_bad_image_folders_are_refused_with_the_reason(tmp_path: Path, case: str, message: str) -> None:
    root = tmp_path / "img"
    root.mkdir()
    if case == "unknown class":
        write_images(root, {"cat": 3, "zebra": 3}, SIZE)
    elif case == "wrong size":
        write_images(root, {"cat": 3}, 12)
    elif case == "wrong mode":
        write_images(root, {"cat": 3}, SIZE, mode="L")
    elif case == "stray file":
        write_images(root, {"cat": 3}, SIZE)
        (root / "notes.txt").write_text("x")
    before = files(tmp_path)
    with pytest.raises(DataError) as err:
        load_source(SourceConfig("folder", str(root)), spec())
    assert message in str(err.value) and (str(root) in str(err.value) or "image " in str(err.value))
    assert files(tmp_path) == before


def test_arrays_source_and_a_label_outside_the_class_list(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, (10, 3, SIZE, SIZE), dtype=np.uint8)
    np.savez(tmp_path / "ok.npz", x=x, y=np.arange(10) % 3)
    from safetensors.numpy import save_file

    save_file({"x": x.astype(np.float32), "y": np.arange(10) % 3}, str(tmp_path / "ok.safetensors"))
    for name in ("ok.npz", "ok.safetensors"):
        data = load_source(SourceConfig("arrays", str(tmp_path / name)), spec())
        assert data.num_train + len(data.val) + len(data.test) == 10
    np.savez(tmp_path / "bad.npz", x=x, y=np.array([0, 1, 2, 5, 0, 1, 2, 0, 1, 2]))
    with pytest.raises(DataError, match=r"label 5 is outside the federation's class list \(labels 0..2"):
        load_source(SourceConfig("arrays", str(tmp_path / "bad.npz")), spec())
    np.savez(tmp_path / "noy.npz", x=x)
    with pytest.raises(DataError, match=r"expected arrays x and y, found \['x'\]"):
        check_source(SourceConfig("arrays", str(tmp_path / "noy.npz")))


def raising_source() -> None:
    raise RuntimeError("sensor offline")


def triple_source(n: int = 6) -> tuple[object, object, object]:
    from torch.utils.data import TensorDataset

    def part(k: int) -> TensorDataset:
        return TensorDataset(torch.zeros(k, 3, SIZE, SIZE), torch.arange(k) % 3)

    return part(n), part(2), part(2)


def test_python_sources(tmp_path: Path) -> None:
    data = load_source(SourceConfig("python", entry=f"{__name__}:triple_source", args={"n": 9}), spec())
    assert (len(data.train), len(data.val), len(data.test)) == (9, 2, 2) and data.train.mean is None
    with pytest.raises(DataError, match=r"python source '.*:raising_source' raised RuntimeError: sensor offline"):
        load_source(SourceConfig("python", entry=f"{__name__}:raising_source"), spec())
    with pytest.raises(DataError, match="cannot import 'no_such_pkg.mod' for entry point"):
        check_source(SourceConfig("python", entry="no_such_pkg.mod:f"))


def test_a_device_whose_model_build_differs_refuses_the_plan_naming_the_tensor() -> None:
    from edge_client.work import EdgeError, decode_global
    from flayer.strategies import make_strategy
    from flayer.update import float_state, state_numpy
    from protocol import WireLimits, encode_state

    federation = spec(width=16)
    torch.manual_seed(0)
    blob = encode_state(state_numpy(float_state(build_model(federation))))
    # this device's fleetmodel builds width 8 for the same plan (another version of the module)
    mine = dataclasses.replace(spec(width=8), fingerprint=federation.fingerprint)
    strategy = make_strategy("fedavg", mine, TrainConfig(), {})
    with pytest.raises(EdgeError, match=r"tensor 'conv1.0.weight': the federation's model has shape \(16, 3, 3, 3\)"
                                        r" float32, this build has shape \(8, 3, 3, 3\)"):
        decode_global(blob, strategy, WireLimits())
    assert decode_global(blob, make_strategy("fedavg", federation, TrainConfig(), {}), WireLimits())


def test_a_kit_with_a_missing_file_is_refused_before_anything_is_unpacked(tmp_path: Path) -> None:
    from transport.kit import KitError, unpack_kit

    kit = tmp_path / "dev-7.tar.gz"
    with tarfile.open(kit, "w:gz") as tar:
        for name, text in [("credentials.toml", "x = 1\n[tls]\n"), ("device.toml", ""), ("START", "")]:
            path = tmp_path / "src" / name
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            tar.add(path, name)
    with pytest.raises(KitError, match=r"missing tls/ca.crt, tls/client.crt, tls/client.key"):
        unpack_kit(kit)
    assert not (tmp_path / "dev-7").exists()


def test_a_corrupt_or_foreign_initial_model_is_refused_before_any_state(tmp_path: Path) -> None:
    from fleetlib import federation_toml

    from coordinator.config import load_coordinator_config
    from flayer.config import ConfigError
    from flayer.state import save_model

    good = spec()
    ckpt = tmp_path / "machine" / "pretrained.safetensors"
    fed = federation_toml(tmp_path / "machine", tmp_path / "coordinator.toml",
                          extra_model='initial_model = "pretrained.safetensors"')
    save_model(ckpt, float_state_of(good), good)
    cfg = load_coordinator_config(fed)
    assert cfg.initial_model == ckpt and cfg.spec.fingerprint == good.fingerprint
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_coordinator_config(fed)
    save_model(ckpt, float_state_of(spec(width=16)), good)
    with pytest.raises(ConfigError, match=r"tensor 'conv1.0.weight': the federation's model has shape \(8, 3, 3, 3\)"):
        load_coordinator_config(fed)
    assert not (tmp_path / "machine" / "state").exists()


def float_state_of(s: ModelSpec) -> dict[str, torch.Tensor]:
    from flayer.update import float_state

    return float_state(build_model(s))


def test_the_plan_carries_the_model_as_scalars() -> None:
    s = spec()
    plan = dataclasses.asdict(s)
    assert all(isinstance(v, (str, int, float, bool)) for v in plan.values())
    assert ModelSpec(**plan) == s and json.loads(s.classes) == CLASSES
    with pytest.raises(ValueError, match="unknown model 'bogus'"):
        ModelSpec("bogus")


def test_flayer_edge_with_an_empty_folder_exits_2_and_writes_nothing(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from cli.main import main
    from transport import Credentials

    (tmp_path / "credentials.toml").write_text(
        Credentials("f", "device", "dev-1", "pw", "127.0.0.1", 1883, 1 << 20).to_toml())
    (tmp_path / "empty").mkdir()
    (tmp_path / "device.toml").write_text('credentials = "credentials.toml"\n[data]\nsource = "folder"\n'
                                          'path = "nowhere"\n[edge]\nstate_dir = "state"\n')
    before = files(tmp_path)
    assert main(["edge", "--config", str(tmp_path / "device.toml"), "--data", str(tmp_path / "empty")]) == 2
    assert f"data folder {tmp_path / 'empty'}: empty" in capsys.readouterr().err
    assert files(tmp_path) == before


def test_every_strategy_runs_a_round_of_a_user_model(tmp_path: Path) -> None:
    from flayer.simulation import simulate
    from flayer.strategies import STRATEGIES, make_strategy

    s = spec()
    clients = [load_source(SourceConfig("folder", str(write_images(tmp_path / f"c{i}", {"cat": 6, "owl": 6}, SIZE,
                                                                   seed=i))), s) for i in range(2)]
    for name in sorted(STRATEGIES):
        strategy = make_strategy(name, s, TrainConfig(lr=0.05, batch_size=4, local_epochs=1), {})
        result = simulate(strategy, clients, 1, 0)
        assert set(result.global_state) == set(float_state_of(s)), name
        assert all(torch.isfinite(v).all() for v in result.global_state.values()), name
        assert len(result.rounds) == 1 and 0 <= result.final_acc <= 1, name


def pooled_model(num_classes: int = 3) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 4 * 4, num_classes))


def test_the_executorch_training_path_refuses_what_it_cannot_run_with_the_reason() -> None:
    from export.et_training import UnsupportedModel, check_training_support

    check_training_support(spec())  # conv + linear: trains through ExecuTorch
    pooled = ModelSpec(f"{__name__}:pooled_model", in_channels=3, height=SIZE, width=SIZE, num_classes=3)
    with pytest.raises(UnsupportedModel, match=r"module 1 \(MaxPool2d\): max_pool2d's backward kernel is wrong"):
        check_training_support(pooled)
