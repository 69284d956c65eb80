"""Broker fixtures: each starts its own broker on a free loopback port and stops it by PID."""

from __future__ import annotations

import pytest
from broker_testlib import start_test_broker, stop_test_broker

from mqtt_broker import mosquitto_available


@pytest.fixture(scope="module", params=["mosquitto", "embedded"])
def any_broker(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The same tests against Mosquitto and against the embedded broker."""
    if request.param == "mosquitto" and not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    rb = start_test_broker(tmp_path_factory.mktemp(f"broker-{request.param}"), request.param)
    request.addfinalizer(lambda: stop_test_broker(rb))
    return rb


@pytest.fixture(scope="module")
def mosquitto_tls(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Mosquitto with a TLS listener that requires client certificates."""
    if not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    rb = start_test_broker(tmp_path_factory.mktemp("broker-tls"), "mosquitto", tls=True)
    request.addfinalizer(lambda: stop_test_broker(rb))
    return rb
