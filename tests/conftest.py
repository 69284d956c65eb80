"""Shared fixtures: small data sets and helpers. Integration fixtures (brokers) live beside their tests."""

from __future__ import annotations

import pytest
import torch

# The suite's models are tiny and several trainers (edge processes, parallel runs) share 2 cores:
# one torch thread each. With 2 threads per trainer on a busy 2-core machine, spinning OpenMP
# threads made tests 10-50x slower (measured).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def digits():
    from flayer.data import load_dataset

    return load_dataset("digits")


@pytest.fixture
def faults_ledger(request):
    """Rows for the fault and security figures (tests/faultledger.py; tabulated by benchmarks/faults.py)."""
    from faultledger import Ledger

    return Ledger.from_env(request.node.nodeid)
