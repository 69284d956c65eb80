"""``flayer emulate --http-models``: nginx serves the coordinator's model files for the run, the devices
fetch the models over HTTP instead of the broker's chunks, and the emulator's ``mb_down`` counts those
bytes (before, it counted the MQTT socket only, so an HTTP run looked as if nothing was downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from emutestlib import emulate, events_of, finish, read_jsonl

from protocol.metrics_schema import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~30 s: nginx, a broker, a coordinator, workers


def test_emulate_over_http_models_counts_the_http_downloads(tmp_path: Path) -> None:
    from coordinator.model_server import find_nginx

    if find_nginx() is None:
        pytest.skip("nginx is not installed (make apt-http)")
    out = tmp_path / "run"
    proc = emulate(["--dataset", "digits", "--strategy", "fedavg", "--partition", "iid", "--lr", "0.05",
                    "--timeout", "240", "--clients", "3", "--rounds", "2", "--mix", "laptop=1",
                    "--quorum", "3", "--over-selection", "1.0", "--min-devices", "3", "--deadline", "30",
                    "--federation", "http3", "--http-models", "--out", str(out)], tmp_path / "emulate.log")
    rc = finish(proc, 300)
    log = (tmp_path / "emulate.log").read_text()
    assert rc == 0, log[-4000:]
    assert "models over HTTP: nginx pid" in log, log[-2000:]
    rows = read_jsonl(out / "rounds.jsonl")
    assert [r["round"] for r in rows] == [1, 2] and all(r["reported"] == 3 for r in rows), rows
    fetched = [e for e in events_of(out) if e.get("kind") == "downloaded"]
    assert len(fetched) >= 6 and all(e.get("via") == "http" for e in fetched), fetched
    served = [line for line in (out / "nginx/access.log").read_text().splitlines() if '" 200 ' in line
              or '" 206 ' in line]
    assert len(served) >= 6, served
    first = next(m for m in read_metrics(out / "coordinator/metrics.jsonl") if m["kind"] == "round")
    model_mb = first["model_bytes"] / 1e6
    assert all(r["mb_down"] >= 3 * model_mb for r in rows), ([r["mb_down"] for r in rows], model_mb)
