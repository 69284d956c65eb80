"""SIGTERM -- what systemd sends to stop a service (docs/howto/service.md) -- to the coordinator and to a device
mid-round, as real processes (``flayer coordinator``, ``flayer edge``, mosquitto), started and signalled by the
PID this test holds. Each exits 143 after a clean stop, is started again over the same state, and the run
loses no acknowledged update (the journal accounting of test_faults_crash.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from faultlib import proc_federation, wait_until
from test_faults_crash import DEVICES, _check_run, _hold_back

from mqtt_broker import mosquitto_available

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]


@pytest.mark.slow  # ~22-34 s here
def test_coordinator_sigterm_mid_round_stops_cleanly_and_loses_no_acknowledged_update(
    tmp_path: Path, digits: Any, faults_ledger: Any
) -> None:
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=3)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        r = _hold_back(fed, "dev-2", range(2, 4))
        assert len(fed.journaled(r)) == 2  # two updates acknowledged, the round not final
        assert fed.coordinator.term() == 143, fed.logs()
        text = fed.coordinator.text()
        assert "stopped by signal 15; run the same command to resume" in text and "Traceback" not in text, text
        fed.procs["dev-2"].resume()
        fed.start_coordinator()
        fed.wait_all(240)
        assert f"replayed 2 journaled update(s) of round {r}" in fed.coordinator.text()
        acked, aggregated = _check_run(fed, digits)
        faults_ledger.fault("coordinator SIGTERM mid-round, restarted", 1, True, acked, aggregated)
    finally:
        fed.stop()


@pytest.mark.slow  # ~40 s here
def test_device_sigterm_mid_round_stops_cleanly_and_its_restart_completes_the_round(
    tmp_path: Path, digits: Any, faults_ledger: Any
) -> None:
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=3)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        r = _hold_back(fed, "dev-2", range(2, 4), settle_s=2.0)  # dev-2 stopped as round r opened: not yet sent
        t0 = time.monotonic()
        assert fed.procs["dev-2"].term() == 143, fed.logs()
        stopped_s = time.monotonic() - t0
        text = fed.procs["dev-2"].text()
        assert "Traceback" not in text, text
        assert r not in fed.closed_rounds()  # quorum = all: the round waits for dev-2
        fed.start_device("dev-2")
        wait_until(lambda: r in fed.closed_rounds(), 120, f"round {r} to close", fed.logs)
        fed.wait_all(240)
        assert (r, "accepted") in fed.device_acks("dev-2")
        print(f"dev-2 stopped {stopped_s:.1f} s after SIGTERM")
        acked, aggregated = _check_run(fed, digits)
        faults_ledger.fault("device SIGTERM mid-round, restarted", 1, True, acked, aggregated)
    finally:
        fed.stop()
