"""A second coordinator started over the state folder of one that runs (docs/explanation/guarantees.md, "No
acknowledged update is lost"; docs/howto/stop-resume.md).

The party is whoever can start ``flayer coordinator`` with the federation's config on the coordinator's host: a
service unit restarted while a run started by hand still holds the folder, or a second shell. Two coordinators over
one folder take the broker session from each other (one client id) and append to the same journal and metrics
file. The guarantee: the second is refused at start (exit 2, one line naming the folder and the first one's PID)
before it connects or writes anything, and the first one runs on. Real processes on a real Mosquitto.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import ROOT

from mqtt_broker import mosquitto_available

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]


def test_a_second_coordinator_over_the_same_state_folder_is_refused(tmp_path: Path, attack_fed: Any) -> None:
    fb = attack_fed(["dev-a"], view="coordinator")  # the party starts flayer coordinator with its config
    fed = fb.federation_config()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-P", "-m", "cli.main", "coordinator", "--config", str(fed)]
    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "coord/metrics.jsonl").exists():  # it holds the folder and waits for devices
            assert first.poll() is None and time.monotonic() < deadline, "the first coordinator did not start"
            time.sleep(0.2)
        metrics_before = (tmp_path / "coord/metrics.jsonl").read_bytes()
        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 2, f"the second coordinator ran (exit {second.returncode}): {second.stderr[-1500:]}"
        assert f"is in use by another process (pid {first.pid})" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        time.sleep(1.0)
        assert first.poll() is None, "the first coordinator stopped"
        assert (tmp_path / "coord/metrics.jsonl").read_bytes() == metrics_before  # the second wrote nothing there
    finally:
        first.terminate()
        first.wait(30)
