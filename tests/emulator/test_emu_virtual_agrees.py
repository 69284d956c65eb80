"""The simulated clock against the real emulator on the demo fleet, asynchronous rounds: per profile,
the numbers of accepted updates agree within the tolerance the docs state (30%, or 3 updates for a
profile with few), except the field sensors, for which the simulated clock is a lower bound: it does not
model the real coordinator's wait for announced uploads (docs/explanation/async-rounds.md). Both read the
same config, profiles, seed and availability timelines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mqtt_broker import mosquitto_available

ROOT = Path(__file__).resolve().parents[2]
# two runs of the demo fleet (about 2 minutes of CPU for the real one): each under 420 s, both under the
# module's 900 s (pytest-timeout's default of 300 s stopped the real run on a busy machine)
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900),
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
ASYNC = ["--mode", "async", "--buffer", "8", "--max-staleness", "32", "--concurrency", "11"]


def _run(out: Path, *extra: str) -> dict[str, dict[str, int]]:
    cmd = [sys.executable, "-m", "cli.main", "emulate", "--config", str(ROOT / "configs/emulate-demo.toml"),
           "--seed", "0", "--rounds", "20", "--out", str(out), *ASYNC, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profiles = json.loads((out / "summary.json").read_text())["profiles"]
    if isinstance(profiles, list):  # the emulator's rows
        return {p["profile"]: p for p in profiles}
    return profiles


def test_simulated_clock_and_emulator_accept_alike(tmp_path: Path) -> None:
    real = _run(tmp_path / "emulator")
    sim = _run(tmp_path / "virtual", "--virtual", "--sample-cost", "0.0005")
    assert set(real) == set(sim)
    for name in real:
        a, b = real[name]["accepted"], sim[name].get("accepted", 0)
        if name == "flaky-field":  # a lower bound: never more than the real fleet's, within the tolerance
            assert b <= a + max(3, 0.3 * a), (name, a, b)
            continue
        assert abs(a - b) <= max(3, 0.3 * max(a, b)), (name, a, b)
