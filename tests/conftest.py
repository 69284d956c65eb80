"""Shared fixtures: small data sets and helpers. Integration fixtures (brokers) live beside their tests."""

from __future__ import annotations

import os

import pytest
import torch

# Tests are small; keep torch from oversubscribing the 2 cores CI has.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def digits():
    from flayer.data import load_dataset

    return load_dataset("digits")


@pytest.fixture
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Torch on one thread for the test: where several trainers share 2 busy cores, 2 threads each
    run ~50x slower than 1 (spinning OpenMP threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
