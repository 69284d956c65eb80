"""Fault-injection and security suite: the helpers of the federation and broker tests are reused from
their folders (fedtestlib, broker_testlib); this suite's own live in faultlib.py and tcpproxy.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def digits_shards(digits):  # type: ignore[no-untyped-def]
    """Four iid shards of sklearn digits (the in-process devices' data)."""
    from flayer.partition import make_partition
    from flayer.train import client_data

    part = make_partition(digits.y, digits.num_classes, 4, "iid", 0)
    return [client_data(digits, c) for c in part.clients]


@pytest.fixture
def live_fed(fed_broker):  # type: ignore[no-untyped-def]
    """Mosquitto with devices dev-a, dev-b, dev-c (selected by the bad-input runs), dev-x (never online)."""
    from faultlib import FEDERATION

    return fed_broker(["dev-a", "dev-b", "dev-c", "dev-x"], federation=FEDERATION)
