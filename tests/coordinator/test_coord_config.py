"""federation.toml: defaults, relative paths, and errors that name the file, table and key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from coordinator.config import DATASET_INPUTS, load_coordinator_config, model_spec_for
from flayer.config import ConfigError

GOOD = """
[federation]
credentials = "broker/credentials/coordinator.toml"
state_dir = "state"
quorum = 2
min_devices = 3
[run]
strategy = "fedavg"
rounds = 4
seed = 5
[data]
dataset = "fmnist"
[train]
lr = 0.01
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "federation.toml"
    p.write_text(text)
    return p


def test_good_file(tmp_path: Path) -> None:
    cfg = load_coordinator_config(_write(tmp_path, GOOD))
    assert cfg.credentials == tmp_path / "broker/credentials/coordinator.toml"
    assert cfg.state_dir == tmp_path / "state"
    assert (cfg.federation.quorum, cfg.federation.min_devices, cfg.run.rounds, cfg.run.seed) == (2, 3, 4, 5)
    assert cfg.train_plan == {"lr": 0.01, "batch_size": 10, "local_epochs": 1}
    assert (cfg.spec.name, cfg.spec.in_channels, cfg.spec.height, cfg.spec.num_classes) == ("cnn", 1, 28, 10)
    over = load_coordinator_config(_write(tmp_path, GOOD), {"federation": {"quorum": 3}, "run": {"rounds": 9}})
    assert over.federation.quorum == 3 and over.run.rounds == 9
    unset = load_coordinator_config(_write(tmp_path, GOOD), {"federation": {"quorum": None}, "run": {"rounds": None}})
    assert unset.federation.quorum == 2 and unset.run.rounds == 4  # flags not given keep the file's values
    short = load_coordinator_config(_write(tmp_path, GOOD.replace("quorum = 2", "quorum = 2\ndeadline_s = 4.0")))
    assert short.federation.announce_wait_s == 10.0  # the default wait stays valid: the deadline bounds the close


@pytest.mark.parametrize("old, new, words", [
    ("quorum = 2", "quorum = 0", "quorum"),
    ("min_devices = 3", "min_devices = 1", "min_devices"),
    ("quorum = 2", "quorum = 2\ncolour = 1", "colour"),
    ("quorum = 2", "quorum = 2\nvalue_codec = 'fp8'", "value_codec"),
    ("quorum = 2", "quorum = 2\nnorm_bound = -1.0", "norm_bound"),
    ("quorum = 2", "quorum = 2\ndelta_downloads = 'bf16'", "delta_downloads"),
    ("quorum = 2", "quorum = 2\nfit_lowest_codec = 'bf16'", "fit_lowest_codec"),
    ("quorum = 2", "quorum = 2\nfit_min_keep = 0.0", "fit_min_keep"),
    ("quorum = 2", "quorum = 2\nannounce_wait_s = -1.0", "announce_wait_s"),
    ("quorum = 2", "quorum = 2\nannounce_wait_s = inf", "announce_wait_s"),
    ("rounds = 4", "rounds = 0", "rounds"),
    ("seed = 5", "seed = -1", "seed"),
    ("lr = 0.01", "lr = 'fast'", r"\[train\]"),
    ("lr = 0.01", "lr = 0.01\n[extra]\nx = 1", "unknown table"),
    ("lr = 0.01", "lr = 0.01\n[strategy.fedavg]\nlayers = [1, 2]", "cannot travel"),
])
def test_errors_name_what_is_wrong(tmp_path: Path, old: str, new: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        load_coordinator_config(_write(tmp_path, GOOD.replace(old, new)))
    assert "federation.toml" in str(info.value)


def test_missing_credentials_and_unavailable_strategy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="credentials"):
        load_coordinator_config(_write(tmp_path, GOOD.replace('credentials = "broker/credentials/coordinator.toml"',
                                                               "")))
    from flayer.strategies import STRATEGIES

    missing = next((s for s in ("playerfl", "ditto", "local") if s not in STRATEGIES), None)
    if missing:
        with pytest.raises(ConfigError, match="not available"):
            load_coordinator_config(_write(tmp_path, GOOD.replace('"fedavg"', f'"{missing}"')))


def test_dataset_table_matches_the_loaders(digits) -> None:  # type: ignore[no-untyped-def]
    assert model_spec_for("digits") == digits.model_spec()
    assert set(DATASET_INPUTS) >= {"fmnist", "mnist", "cifar10", "cifar100", "tiny-imagenet"}
    with pytest.raises(ConfigError, match="explicit"):
        model_spec_for("agnews")


def test_checkpoint_round_trip_and_identity(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 2), "b": torch.zeros(3)}
    ident = {"strategy": "fedavg", "seed": 1}
    assert load_checkpoint(tmp_path, ident) is None
    save_checkpoint(tmp_path, Checkpoint(4, state, "ab" * 32, ident, {"late": 2}, {"x": 1}))
    ck = load_checkpoint(tmp_path, ident)
    assert ck is not None and ck.round == 4 and ck.counters == {"late": 2} and ck.options == {"x": 1}
    assert torch.equal(ck.global_state["w"], state["w"])
    with pytest.raises(CheckpointError, match="seed"):
        load_checkpoint(tmp_path, {"strategy": "fedavg", "seed": 2})
    (tmp_path / "checkpoint.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path, ident)


@pytest.mark.parametrize("models_dir", [".", "state", "broker", "broker/credentials"])
def test_a_models_dir_that_would_serve_the_state_or_the_credentials_is_refused(tmp_path: Path,
                                                                              models_dir: str) -> None:
    """nginx serves everything under models_dir to every device: the journals (every device's update) and the
    coordinator's credentials (its password and signing key) must not be under it."""
    text = GOOD.replace('state_dir = "state"',
                        f'state_dir = "state"\nmodels_dir = "{models_dir}"\nmodels_url = "http://127.0.0.1:8080"')
    with pytest.raises(ConfigError, match="models_dir .* would serve"):
        load_coordinator_config(_write(tmp_path, text))


@pytest.mark.parametrize("models_dir", ["models", "state/models"])
def test_a_models_dir_of_its_own_is_taken(tmp_path: Path, models_dir: str) -> None:
    text = GOOD.replace('state_dir = "state"',
                        f'state_dir = "state"\nmodels_dir = "{models_dir}"\nmodels_url = "http://127.0.0.1:8080"')
    assert load_coordinator_config(_write(tmp_path, text)).models_dir == (tmp_path / models_dir).resolve()
