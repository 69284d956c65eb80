"""A private federation whose ``[privacy] population`` understates the devices that take part
(docs/explanation/privacy.md, "The accountant": a delta of 1/N or more is refused).

delta < 1/N is what keeps (epsilon, delta) from allowing a mechanism that publishes one device's data whole:
with delta >= 1/N such a mechanism satisfies the guarantee. The coordinator checks delta against the
``population`` N its config states, a number it cannot verify at the start. The adversary is an observer of
the broker (or any device): it reads the devices' statuses and the plans, so it counts the devices that report
and reads the delta the plans state. Here the config says N = 2 and delta = 0.4 (< 1/2), and four devices
report. The guarantee: no private plan goes out whose delta is 1/N or more for the N devices that reported
before it -- the coordinator stops instead, saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attacklib import brokerless_coordinator

from coordinator.config import load_coordinator_config
from protocol import SigningKey, Status
from transport.credentials import Credentials

DEVICES = ["dev-0", "dev-1", "dev-2", "dev-3"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())


def _config(tmp: Path) -> Any:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 2", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 60.0", "grace_s = 0.0",
             "[run]", 'strategy = "fedavg"', "rounds = 2", "seed = 3", "[data]", 'dataset = "digits"',
             "[privacy]", "enabled = true", "population = 2", "clip = 0.3", "noise_multiplier = 1.0", "delta = 0.4"]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    return load_coordinator_config(tmp / "federation.toml")


def test_no_private_plan_states_a_delta_of_one_over_the_devices_that_reported(tmp_path: Path) -> None:
    now = [1000.0]
    c, plans = brokerless_coordinator(_config(tmp_path), CREDS, lambda: now[0], drop_acks=False)
    reported: set[str] = set()
    try:
        for d in DEVICES:  # what the observer reads on the status topics
            c.registry.observe(d, Status(0, "online", now[0]), now[0])
            reported.add(d)
        c._tick()
        private = [p for p in plans if p.privacy]
        for p in private:
            delta = float(p.privacy["delta"])
            assert delta < 1.0 / len(reported), (
                f"round {p.round}'s plan states delta {delta} with {len(reported)} devices reporting: at delta >= "
                f"1/N a mechanism that publishes one device's data whole satisfies the guarantee")
        assert private or c.cycle.budget_stop, "the coordinator neither opened a round nor said why it stopped"
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()
