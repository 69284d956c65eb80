"""A private emulated fleet: ``flayer emulate --dp central`` (a broker process, the coordinator process,
worker processes) writes [privacy] into its coordinator's federation.toml with the fleet as population;
every round record carries the accountant's epsilon at q = 1 (the plans list the cohort) against readers of the
models and plans, and infinite against the coordinator (central noise), and the summary states both."""

from __future__ import annotations

from pathlib import Path

import pytest
from emutestlib import emulate, finish

from flayer.engine.accountant import epsilon_for
from protocol.metrics_schema import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_private_fleet_states_its_epsilon(tmp_path: Path) -> None:
    out = tmp_path / "emu"
    proc = emulate(["--dataset", "digits", "--clients", "6", "--rounds", "2", "--quorum", "3", "--min-devices", "3",
                    "--dp", "central", "--dp-noise", "0.8", "--dp-clip", "0.5", "--workers", "1", "--out", str(out)],
                   tmp_path / "emulate.log")
    assert finish(proc, 240) == 0, (tmp_path / "emulate.log").read_text()[-3000:]
    assert "[privacy]" in (out / "federation.toml").read_text()
    rounds = [r for r in read_metrics(out / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
    delta = 1e-5
    assert [r["epsilon"] for r in rounds] == pytest.approx([epsilon_for([(0.8, 1.0, t)], delta) for t in (1, 2)])
    assert all(r["epsilon_coordinator"] == "inf" for r in rounds)
    log = (tmp_path / "emulate.log").read_text()
    assert (f"privacy: epsilon {rounds[-1]['epsilon']:.4g} at delta {delta:.3g} after 2 rounds for a device in every "
            f"round (no max_participations), against readers of the published models") in log
    assert "privacy: epsilon infinite against the coordinator" in log


def test_a_secure_fleet_folds_only_sums_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "emu"
    proc = emulate(["--dataset", "digits", "--clients", "5", "--rounds", "2", "--quorum", "3", "--min-devices", "4",
                    "--secure-agg", "--workers", "1", "--out", str(out)], tmp_path / "emulate.log")
    assert finish(proc, 240) == 0, (tmp_path / "emulate.log").read_text()[-3000:]
    assert "secure_aggregation = true" in (out / "federation.toml").read_text()
    rounds = [r for r in read_metrics(out / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
    assert len(rounds) == 2 and all(r["secure_abandoned"] is None and len(r["secure_survivors"]) >= 3 for r in rounds)
    assert all(r["accepted"] == len(r["secure_survivors"]) for r in rounds)
    assert "secure aggregation: 2 of 2 rounds unmasked" in (tmp_path / "emulate.log").read_text()
