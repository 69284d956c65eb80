"""A device in a private round (edge_client.work): it clips what leaves it, adds its noise share in local
mode from its own entropy (two runs differ), skips link fitting (data-dependent), and skips a round whose
privacy parameters are malformed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from coordinator.publish import model_blob
from edge_client.work import SkipRound, StrategyCache, round_context, train_and_encode
from flayer.engine import initial_global_state
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import Plan, WireLimits, decode_update


@pytest.fixture(scope="module")
def setup(digits: Any) -> Any:
    shard = client_data(digits, make_partition(digits.y, digits.num_classes, 3, "iid", 0).clients[1])
    spec = dataclasses.asdict(digits.model_spec())
    base = {"round": 2, "selected": ("dev-1", "dev-2", "dev-3", "dev-4"), "deadline": 1e9, "strategy": "fedavg", "options": {}, "model": spec,
            "model_digest": "ab" * 32, "model_chunks": 1, "model_size": 1, "seed": 3,
            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))  # type: ignore[arg-type]
    g = initial_global_state(strategy, 3)
    return shard, strategy, g, {**base, "model_digest": model_blob(g).digest}


def _upload(setup: Any, privacy: dict[str, Any], prepare: Any = None) -> tuple[Any, float]:
    shard, strategy, g, base = setup
    plan = Plan(**{**base, "privacy": privacy})
    up = train_and_encode(strategy, plan, g, strategy.initial_state(), shard, round_context(plan, 1, torch.device("cpu")),
                          federation="fed", sender="dev-1", max_payload=1 << 20, max_update_bytes=0, amp=False,
                          prepare=prepare)
    u = decode_update(up.blob, WireLimits()).update
    return u, math.sqrt(sum(float((d.values.astype("float64") ** 2).sum()) for d in u.deltas.values()))


def test_a_private_device_clips_and_never_fits_its_upload(setup: Any) -> None:
    def fit(update: Any) -> Any:
        raise AssertionError("link fitting chooses from the device's data: not in a private round")

    central = RoundPrivacy("central", 0.05, 1.0, 1.0, 4).as_plan()
    u, norm = _upload(setup, central, fit)
    assert norm <= 0.05 * (1 + 1e-5) and set(u.info) <= {"test_correct", "test_total", "train_loss"}
    _, plain = _upload(setup, {})
    assert plain > 0.05  # without [privacy] the same round is not clipped


def test_local_noise_comes_from_the_devices_own_entropy(setup: Any) -> None:
    local = RoundPrivacy("local", 0.05, 1.0, 1.0, 4).as_plan()
    a, _ = _upload(setup, local)
    b, _ = _upload(setup, local)
    assert any(not (a.deltas[k].values == b.deltas[k].values).all() for k in a.deltas)  # not replayable


def test_malformed_privacy_parameters_skip_the_round(setup: Any) -> None:
    with pytest.raises(SkipRound, match="privacy"):
        _upload(setup, {"mode": "central", "clip": -1.0, "noise_multiplier": 1.0, "update_multiplier": 1.0,
                        "contributions": 2})


def test_a_private_upload_carries_a_fixed_weight_and_no_evaluation(setup: Any) -> None:
    u, _ = _upload(setup, RoundPrivacy("central", 0.05, 1.0, 1.0, 4).as_plan())
    assert u.num_samples == 1 and u.info == {}  # no sample count, no test counts, no loss
    adaptive = {**RoundPrivacy("central", 0.05, 1.0, 0.75 ** -0.5, 4, adaptive=True, bit_std=2.0).as_plan()}
    u, _ = _upload(setup, adaptive)
    assert set(u.info) == {"dp_unclipped"} and u.num_samples == 1
    plain, _ = _upload(setup, {})
    assert plain.num_samples > 1 and "test_correct" in plain.info  # without [privacy]: as before


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_non_finite_local_round_sends_a_neutral_contribution(setup: Any, mode: str) -> None:
    from edge_client.work import private_upload
    from flayer.strategies.base import LocalResult
    from flayer.update import TensorDelta, Update

    good, _ = _upload(setup, {})
    bad = {k: TensorDelta(d.shape, d.values * float("nan"), d.indices) for k, d in good.deltas.items()}
    plan = Plan(**{**setup[3], "privacy": RoundPrivacy(mode, 0.05, 1.0, 1.0, 4).as_plan()})
    up, kept = private_upload(plan, LocalResult(Update(bad, 7, {"train_loss": 0.1}), None, {}),  # type: ignore[arg-type]
                              RoundPrivacy(mode, 0.05, 1.0, 1.0, 4))
    assert not kept and up.num_samples == 1 and up.info == {}
    assert {k: (d.shape, d.values.size) for k, d in up.deltas.items()} == \
        {k: (d.shape, d.values.size) for k, d in good.deltas.items()}  # the same layout as any upload
    values = [float(v) for d in up.deltas.values() for v in d.values[:50]]
    assert all(math.isfinite(v) for v in values)
    if mode == "central":
        assert all(v == 0.0 for v in values)
    else:  # its noise share, like every local-mode upload
        assert any(v != 0.0 for v in values)
