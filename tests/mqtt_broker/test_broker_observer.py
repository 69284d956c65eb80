"""The read-only observer (``flayer status``, ``flayer dashboard``) probed against a real Mosquitto:
it receives the round plan, statuses and metrics and nothing else, and nothing it publishes arrives."""

from __future__ import annotations

from pathlib import Path

import pytest
from broker_testlib import FEDERATION, needs_mosquitto, run_acl_matrix, start_test_broker

from mqtt_broker import BrokerConfigError, add_device, load_credentials
from protocol.topics import Topics

pytestmark = [pytest.mark.integration, needs_mosquitto]
T = Topics(FEDERATION)


def test_observer_reads_plan_status_and_metrics_only_and_publishes_nothing(tmp_path: Path) -> None:
    rb = start_test_broker(tmp_path / "broker", "mosquitto")
    try:
        creds = {**rb.creds, "observer": load_credentials(rb.files.state_dir, "observer")}
        assert creds["observer"].role == "observer"
        expected, observed = run_acl_matrix(rb.files.acl, creds, FEDERATION)
    finally:
        rb.broker.stop()
    assert not expected - observed and not observed - expected  # Mosquitto enforces the ACL as parsed
    # what the observer received, by topic, from whichever publisher was allowed to write it
    got = {topic for sub, _, topic in observed if sub == "observer"}
    assert got == {T.round(), T.status("dev-a"), T.status("dev-b"), T.status("coordinator"),
                   T.metrics("dev-a"), T.metrics("dev-b"), T.metrics("coordinator")}
    assert not any(pub == "observer" for _, pub, _ in observed), "a message the observer published arrived"
    # the positive controls of the same run: devices and the coordinator did get through
    assert ("observer", "coordinator", T.round()) in observed and ("coordinator", "dev-a", T.status("dev-a")) in observed


def test_no_device_may_take_the_observers_name(tmp_path: Path) -> None:
    rb = start_test_broker(tmp_path / "broker", "mosquitto")
    rb.broker.stop()
    with pytest.raises(BrokerConfigError, match="observer"):
        add_device(rb.files.state_dir, "observer")
