"""Small real fixtures for the strategy tests: sklearn digits split over a few clients."""

from __future__ import annotations

import pytest

from flayer.config import TrainConfig
from flayer.partition import make_partition
from flayer.train import client_data


@pytest.fixture(scope="session")
def digits_clients(digits):
    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", 0, batch_size=10)
    return [client_data(digits, c) for c in part.clients]


@pytest.fixture(scope="session")
def digits_spec(digits):
    return digits.model_spec()


@pytest.fixture(scope="session")
def train_cfg():
    return TrainConfig(lr=0.05, batch_size=10, local_epochs=1, device="cpu")
