"""The read-only observer (``flayer status``, ``flayer dashboard``) probed against a real Mosquitto:
it receives the round plan, statuses and metrics and nothing else, and nothing it publishes arrives."""

from __future__ import annotations

from pathlib import Path

import pytest
from broker_testlib import FEDERATION, needs_mosquitto, run_acl_matrix, start_test_broker, wait_connectable

from mqtt_broker import BrokerConfigError, add_device, add_observer, load_credentials
from protocol.topics import Topics

pytestmark = [pytest.mark.integration, needs_mosquitto]
T = Topics(FEDERATION)


def test_observer_reads_plan_status_and_metrics_only_and_publishes_nothing(tmp_path: Path) -> None:
    rb = start_test_broker(tmp_path / "broker", "mosquitto")
    try:
        second = add_observer(rb.files.state_dir, "watcher-2")  # a second watcher, added to the running broker
        rb.broker.reload()
        wait_connectable(second)
        creds = {**rb.creds, "observer": load_credentials(rb.files.state_dir, "observer"), "watcher-2": second}
        assert creds["observer"].role == "observer" == second.role
        expected, observed = run_acl_matrix(rb.files.acl, creds, FEDERATION)
    finally:
        rb.broker.stop()
    assert not expected - observed and not observed - expected  # Mosquitto enforces the ACL as parsed
    for me, other in (("observer", "watcher-2"), ("watcher-2", "observer")):
        # what each observer received, by topic, from whichever publisher was allowed to write it; the
        # coordinator may write any metrics topic (only to empty what a device left retained there), so the
        # other observer's metrics name reaches it too, never its own
        got = {topic for sub, _, topic in observed if sub == me}
        assert got == {T.round(), *(T.status(u) for u in ("dev-a", "dev-b", "coordinator")),
                       *(T.metrics(u) for u in ("dev-a", "dev-b", "coordinator", other))}, me
        assert not any(pub == me for _, pub, _ in observed), f"a message {me} published arrived"
    # the positive controls of the same run: devices and the coordinator did get through
    assert ("observer", "coordinator", T.round()) in observed and ("coordinator", "dev-a", T.status("dev-a")) in observed


def test_no_device_may_take_the_observers_name(tmp_path: Path) -> None:
    rb = start_test_broker(tmp_path / "broker", "mosquitto")
    rb.broker.stop()
    with pytest.raises(BrokerConfigError, match="observer"):
        add_device(rb.files.state_dir, "observer")
