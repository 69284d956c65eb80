"""Shared fixtures: small data sets and helpers. Integration fixtures (brokers) live beside their tests."""

from __future__ import annotations

import os
import sys

# The suite's models are tiny and several trainers (edge processes, parallel runs) share 2 cores:
# one torch thread each. With 2 threads per trainer on a busy 2-core machine, spinning OpenMP
# threads made tests 10-50x slower (measured). The variables are set before torch is imported, so
# every process a test starts (`flayer simulate`, `flayer edge`, emulator workers) inherits them.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

# Bytecode caches (__pycache__, ignored by git) are written even where PYTHONDONTWRITEBYTECODE is set: without
# them every process a test starts compiled the project's modules again (about 0.2 s of CPU each), and every
# pytest run rewrote the asserts of every test module on each worker (a collection of 13.5 s of CPU instead of
# 6.2 s). Set here, before the test modules are collected, and inherited by the processes the tests start.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# the federation and broker test helpers (fedtestlib, broker_testlib) for every folder's tests
_TESTS = Path(__file__).resolve().parent
for _sub in ("integration", "mqtt_broker"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))


# The modules that take longest, first. make test runs pytest-xdist with --dist loadscope
# --no-loadscope-reorder: a module's tests stay on one worker and the modules are handed out in collection
# order, so these start first and the short modules at the end even out the two workers' finishing times.
# (xdist's default reorder hands out the modules with the most tests first, which left these long,
# few-test modules for last: one worker ran them while the other idled.) Ordered by their durations in
# the default run (docs/howto/test-suite.md); a module missing here only starts later.
LONGEST_FIRST = (
    "tests/integration/test_federation_executorch.py",
    "tests/integration/test_federation_thin.py",
    "tests/export/test_export_parity.py",
    "tests/faults/test_faults_flood_norm.py",
    "tests/faults/test_faults_crash.py",
    "tests/export/test_export_cli.py",
    "tests/integration/test_federation_rounds.py",
    "tests/faults/test_faults_hostile.py",
    "tests/flayer/test_accountant.py",
    "tests/export/test_export_et_training.py",
    "tests/strategies/test_simulate_all.py",
    "tests/emulator/test_emu_links.py",
    "tests/emulator/test_emu_fleet.py",
    "tests/faults/test_faults_refusal_flood.py",
    "tests/integration/test_federation_refusals.py",
    "tests/mqtt_broker/test_broker_live.py",
    "tests/coordinator/test_status.py",
    "tests/integration/test_federation_entry_points.py",
    "tests/emulator/test_emu_virtual_links.py",
    "tests/emulator/test_emu_virtual.py",
    "tests/cli/test_cli.py",
    "tests/flayer/test_secure_rounds.py",
    "tests/flayer/test_simulator.py",
    "tests/cli/test_simulate_thin.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def digits():
    from flayer.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="session")
def digits_shard(digits):
    """``digits_shard(index, clients=2, seed=0)``: client ``index``'s shard of sklearn digits split iid across
    ``clients`` (its ClientData), made once per worker: the tests read it and never change it."""
    from flayer.partition import make_partition
    from flayer.train import client_data

    made: dict[tuple[int, int, int], object] = {}

    def shard(index: int, clients: int = 2, seed: int = 0):
        key = (index, clients, seed)
        if key not in made:
            part = make_partition(digits.y, digits.num_classes, clients, "iid", seed)
            made[key] = client_data(digits, part.clients[index])
        return made[key]

    return shard


@pytest.fixture
def fed_broker(tmp_path):
    """``fed_broker(devices, kind="mosquitto", federation="itest", at=None, **broker_config)``: a broker of
    ``kind`` on a free loopback port, its state folder ``tmp_path / "broker"`` (``at / "broker"``) holding the
    accounts of ``devices`` and the coordinator (fedtestlib.start_fed_broker); stopped by its PID after the
    test. The test is skipped where mosquitto is not installed. The fault, integration and attack tests'
    federations (tests/attacks/conftest.py builds the adversary's view on it)."""
    from fedtestlib import start_fed_broker

    from mqtt_broker import mosquitto_available

    started = []

    def start(devices, kind="mosquitto", federation="itest", at=None, **broker):
        if kind == "mosquitto" and not mosquitto_available():
            pytest.skip("mosquitto is not installed")
        tmp = at if at is not None else tmp_path / f"fed-{len(started)}" if started else tmp_path
        fb = start_fed_broker(tmp, kind, list(devices), federation=federation, **broker)
        started.append(fb)
        return fb

    yield start
    for fb in reversed(started):
        fb.broker.stop()


@pytest.fixture
def faults_ledger(request):
    """Rows for the fault and security figures (tests/faultledger.py; tabulated by benchmarks/faults.py)."""
    from faultledger import Ledger

    return Ledger.from_env(request.node.nodeid)
