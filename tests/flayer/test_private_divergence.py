"""``flayer simulate`` in private runs decides nothing from the devices' un-noised data: it does not stop on
the training loss, and a client whose local round goes non-finite sends a neutral contribution (as a device
does, edge_client.work.private_upload) instead of stopping the run; a non-private run stops as before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flayer.config import TrainConfig
from flayer.engine.round import RoundRecord
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings
from flayer.simulation import divergence, simulate
from flayer.strategies import make_strategy
from flayer.train import client_data


def test_a_private_run_does_not_stop_on_the_training_loss() -> None:
    rec = RoundRecord(1, 0.5, 1.0, float("nan"), (0,), 1, 1, 0, 0.1, (0.5,))
    g = {"w": torch.zeros(3)}
    assert divergence([rec], g, None, 10) is not None
    assert divergence([rec], g, None, 10, private=True) is None
    assert divergence([rec], {"w": torch.tensor([float("nan")])}, None, 10, private=True) is not None  # public


@pytest.mark.parametrize("mode", ["central", "local"])
def test_non_finite_local_rounds_send_neutral_contributions_in_private_runs(digits: Any, mode: str) -> None:
    part = make_partition(digits.y, 10, 4, "iid", 0, samples=400)
    clients = [client_data(digits, c) for c in part.clients]
    blowup = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=1e30, batch_size=10, local_epochs=1), {})
    assert simulate(blowup, clients, 2, 0).diverged is not None  # not private: the run stops
    out = simulate(blowup, clients, 2, 0, privacy=PrivacySettings(enabled=True, mode=mode, clip=0.5,  # type: ignore[arg-type]
                                                                   noise_multiplier=1.0, delta=0.01))
    assert out.diverged is None and len(out.rounds) == 2
    assert all(bool(torch.isfinite(v).all()) for v in out.global_state.values() if v.is_floating_point())
