"""``flayer emulate`` with the thin-link options: delta downloads, link-fitted uploads and error feedback
on devices behind a 1 Mbit/s uplink. After round 1 the devices download deltas (fewer MB down per round),
and every round closes with every device's update."""

from __future__ import annotations

from pathlib import Path

import pytest
from emutestlib import emulate, finish, read_jsonl

from protocol.metrics_schema import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~30 s: a broker, a coordinator and workers

PROFILES = """
[profile.thin]
up_mbps = 1.0
down_mbps = 4.0
up_latency_ms = 50.0
down_latency_ms = 50.0
[mix]
thin = 1.0
"""


def test_emulate_with_delta_downloads_and_fitted_uploads(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(PROFILES)
    out = tmp_path / "run"
    proc = emulate(["--dataset", "digits", "--strategy", "fedavg", "--partition", "iid", "--lr", "0.05",
                    "--timeout", "240", "--clients", "3", "--rounds", "3", "--profiles", str(profiles),
                    "--quorum", "3", "--over-selection", "1.0", "--min-devices", "3", "--deadline", "30",
                    "--federation", "thin3", "--delta-downloads", "int8", "--upload", "fit", "--error-feedback",
                    "--out", str(out)], tmp_path / "emulate.log")
    rc = finish(proc, 300)
    log = (tmp_path / "emulate.log").read_text()
    assert rc == 0, log[-4000:]
    rows = read_jsonl(out / "rounds.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3] and all(r["reported"] == 3 for r in rows), rows
    metrics = [m for m in read_metrics(out / "coordinator/metrics.jsonl") if m["kind"] == "round"]
    model_mb = metrics[0]["model_bytes"] / 1e6
    assert rows[0]["mb_down"] >= 3 * model_mb  # round 1: the whole model to each device
    assert all(r["mb_down"] < 0.6 * rows[0]["mb_down"] for r in rows[1:]), [r["mb_down"] for r in rows]
