"""Shared fixtures: small data sets and helpers. Integration fixtures (brokers) live beside their tests."""

from __future__ import annotations

import os

# The suite's models are tiny and several trainers (edge processes, parallel runs) share 2 cores:
# one torch thread each. With 2 threads per trainer on a busy 2-core machine, spinning OpenMP
# threads made tests 10-50x slower (measured). The variables are set before torch is imported, so
# every process a test starts (`flayer simulate`, `flayer edge`, emulator workers) inherits them.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import pytest
import torch

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
