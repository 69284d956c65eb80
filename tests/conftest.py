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
