"""Fault-injection and security suite: the helpers of the federation and broker tests are reused from
their folders (fedtestlib, broker_testlib); this suite's own live in faultlib.py and tcpproxy.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent.parent
for _sub in ("integration", "mqtt_broker"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))


@pytest.fixture(scope="module")
def digits_shards(digits):  # type: ignore[no-untyped-def]
    """Four iid shards of sklearn digits (the in-process devices' data)."""
    from flayer.partition import make_partition
    from flayer.train import client_data

    part = make_partition(digits.y, digits.num_classes, 4, "iid", 0)
    return [client_data(digits, c) for c in part.clients]


@pytest.fixture
def live_fed(tmp_path):  # type: ignore[no-untyped-def]
    """Mosquitto with devices dev-a, dev-b, dev-c (selected by the bad-input runs), dev-x (never online)."""
    from faultlib import FEDERATION
    from fedtestlib import start_fed_broker

    fb = start_fed_broker(tmp_path, "mosquitto", ["dev-a", "dev-b", "dev-c", "dev-x"], federation=FEDERATION)
    yield fb
    fb.broker.stop()
