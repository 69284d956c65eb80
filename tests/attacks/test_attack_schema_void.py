"""Rounds a hostile device gets abandoned before their unmasking use up no honest device's participation slots
(docs/explanation/privacy.md, "The participation schema", "Void rounds").

A private secure federation under the schema max_participations = 1 over a real Mosquitto, a real coordinator and
two honest edge clients, each run from its kit. The adversary is one selected device, mallory: its own kit (key and
certificate), the plan, the messages addressed to it, what it sends under its own topics. It takes part in the keys
and the shares of round 1, then goes offline (its own retained status) and comes back silent: the round is
abandoned before any unmask request, and no device's input is in any sum. On the code before, the coordinator still
counted round 1 in each honest device's k = 1, so round 2 had no eligible device and the federation ended after
round 1 ("participation schema: round 2 ..."): the honest devices' only slots were burnt by a round that spent
nothing. Now round 2 opens with them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from attacklib import ProtocolDevice, until
from attacklib_secagg import kit_fleet
from fedtestlib import federation_toml

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from mqtt_broker.kit import write_kit
from protocol.metrics_schema import read_metrics
from transport.credentials import Credentials
from transport.kit import unpack_kit

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HONEST = ["dev-0", "dev-1"]


def _kit(fb: Any, tmp: Path, name: str) -> Path:
    """``flayer broker add-device NAME --kit``, unpacked on the device's machine: its folder."""
    return unpack_kit(write_kit(fb.state_dir, name, tmp / f"machine-{name}" / f"{name}.tar.gz")).parent


class _Mallory(ProtocolDevice):
    """Keys and shares of the first round it is selected for (its own key and certificate, as any device), then
    offline for a few seconds (its own retained status), then online and silent."""

    def __init__(self, kit: Path) -> None:
        super().__init__(Credentials.load(kit / "credentials.toml"), cert=(kit / "device.cert").read_bytes())

    def one_round(self, timeout: float = 120.0) -> int | None:
        return self.keys_shares_then_away(0, timeout)


@pytest.mark.timeout(400)
def test_a_round_abandoned_before_its_unmasking_leaves_the_honest_devices_eligible(tmp_path: Path,
                                                                                  digits: Any) -> None:
    with kit_fleet(tmp_path, digits, HONEST, others=["mallory"]) as (fb, _devices):
        mallory = _Mallory(_kit(fb, tmp_path, "mallory"))
        try:
            _round_after_the_void(tmp_path, fb, mallory)
        finally:
            mallory.close()


def _round_after_the_void(tmp_path: Path, fb: Any, mallory: _Mallory) -> None:
    """A secure federation (schema: one round each) whose first round mallory abandons before its unmasking; the
    honest devices must still be selected for the second."""
    time.sleep(2.0)
    fed = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                          tmp_path / "coord", strategy="flayer", rounds=2, dataset="digits", seed=0, lr=0.05,
                          quorum=3, min_devices=3, deadline_s=120.0)
    fed.write_text(fed.read_text() + '[privacy]\nsecure_aggregation = true\nsecure_stage_s = 10.0\n'
                   'enabled = true\nmode = "local"\nclip = 0.5\nnoise_multiplier = 1.0\npopulation = 40\n'
                   'max_participations = 1\n')
    coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
    thread = coord.start()
    assert mallory.one_round() == 1
    metrics = tmp_path / "coord/metrics.jsonl"

    def record(r: int) -> dict[str, Any] | None:
        if not metrics.exists():
            return None
        return next((x for x in read_metrics(metrics) if x["kind"] == "round" and x["round"] == r), None)

    assert until(lambda: record(1) is not None, 90.0), "round 1 did not close"
    first = record(1)
    assert first is not None and first["secure_abandoned"] is not None, first
    assert set(HONEST) <= set(first["selected"]), first["selected"]
    thread.join(180)
    assert coord.cycle.budget_stop is None or "participation schema: round 2" not in coord.cycle.budget_stop, \
        f"the honest devices' slots were used up by a round that revealed nothing: {coord.cycle.budget_stop}"
    second = record(2)
    assert second is not None, f"round 2 never opened: {coord.cycle.budget_stop}"
    assert set(HONEST) <= set(second["selected"]), second["selected"]
