"""``flayer dashboard`` started before the coordinator wrote its metrics file waits for it (docs/howto/watch-fleet.md):
it serves the page at once and reads the file once it appears."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from protocol.metrics_schema import MetricsFile, run_record

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(port: int) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/snapshot", timeout=5) as resp:
        return json.loads(resp.read())


def test_the_dashboard_waits_for_a_metrics_file_not_written_yet(tmp_path: Path) -> None:
    state = tmp_path / "federation"
    state.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "cli.main", "dashboard", str(state), "--port", "0"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        port = int(match.group(1))
        assert _snapshot(port)["run"] == {}
        MetricsFile(state / "metrics.jsonl").write(run_record("coordinator", time.time(), "fedavg", 3, None,
                                                              federation="waited"))
        deadline = time.monotonic() + 10
        while _snapshot(port)["run"].get("federation") != "waited":
            assert time.monotonic() < deadline, "the dashboard did not read the metrics file once it appeared"
            time.sleep(0.2)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert f"waiting for {state / 'metrics.jsonl'}" in err, err


def test_a_metrics_file_in_a_folder_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-P", "-m", "cli.main", "dashboard", "--metrics",
                          str(tmp_path / "nowhere/metrics.jsonl"), "--port", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert got.returncode == 2 and "does not exist" in got.stderr and "Traceback" not in got.stderr, got.stderr
