"""Local-mode uploads the coordinator received but did not fold, left out of its epsilon (docs/explanation/privacy.md,
"Who learns what": local mode, the figure against the coordinator).

In local mode without secure aggregation the coordinator is an adversary that sees each device's upload with only
that device's own noise share, so ``epsilon_coordinator`` must compose every round a device may have uploaded in,
not only the rounds whose uploads were folded. The adversary is the coordinator: it lets a round pass its deadline
with nothing folded and keeps the uploads that arrive after it, refused as late. The devices are the real upload
path (:func:`edge_client.work.train_and_encode`); the coordinator is the real loop (no broker). The guarantee:
the round record's ``epsilon_coordinator`` after that round covers the uploads the coordinator received in it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from attacklib import brokerless_coordinator

from coordinator.config import load_coordinator_config
from edge_client.work import StrategyCache, round_context, train_and_encode
from flayer.engine.accountant import epsilon_for
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import SigningKey, Status, Topics
from transport.credentials import Credentials
from transport.link import Received

DEVICES = ["dev-0", "dev-1"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS = {d: SigningKey.generate() for d in DEVICES}


def _config(tmp: Path) -> Any:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 2", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 10.0", "grace_s = 0.0", "min_updates = 1",
             "[run]", 'strategy = "fedavg"', "rounds = 2", "seed = 3", "[data]", 'dataset = "digits"',
             "[privacy]", "enabled = true", 'mode = "local"', "population = 4", "clip = 0.3",
             "noise_multiplier = 1.0", "delta = 0.01"]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    return load_coordinator_config(tmp / "federation.toml")


@pytest.fixture(scope="module")
def datas(digits: Any) -> list[Any]:
    part = make_partition(digits.y, 10, 2, "iid", seed=3, samples=120)
    return [client_data(digits, c) for c in part.clients]


def test_uploads_received_after_an_empty_close_are_in_the_coordinators_epsilon(tmp_path: Path, datas: Any) -> None:
    now = [1000.0]
    records: list[dict[str, Any]] = []
    c, plans = brokerless_coordinator(_config(tmp_path), CREDS, lambda: now[0], KEYS, on_round=records.append)
    for d in DEVICES:
        c.registry.observe(d, Status(0, "online", now[0]), now[0])
    try:
        c._tick()
        plan = plans[-1]
        rp = RoundPrivacy.from_plan(plan.privacy)
        assert rp is not None and rp.mode == "local"
        before = {k: v.clone() for k, v in c.global_state.items()}
        strategy = StrategyCache({"lr": 0.05, "batch_size": 10, "local_epochs": 1, "device": "cpu"}).get(plan)
        uploads = [train_and_encode(strategy, plan, before, strategy.initial_state(), datas[i],
                                    round_context(plan, i, torch.device("cpu")), federation="utest", sender=dev,
                                    max_payload=1 << 20, max_update_bytes=0, amp=False, key=KEYS[dev])
                   for i, dev in enumerate(DEVICES)]
        now[0] += 60.0  # past the deadline: the adversary closes round 1 with nothing folded
        c._tick()
        assert records and records[0]["round"] == 1 and records[0]["accepted"] == 0
        for dev, up in zip(DEVICES, uploads):  # they arrive now: the coordinator reads them, then refuses them
            for k, chunk in enumerate(up.payloads):
                c.intake.on_message(Received(Topics("utest").update_chunk(dev, plan.round, k), chunk, False))
        got = records[0]["epsilon_coordinator"]
        got = math.inf if got == "inf" else float(got)
        seen = epsilon_for([(rp.update_multiplier / math.sqrt(rp.contributions), 1.0, 1)], float(records[0]["delta"]))
        assert got >= seen * (1 - 1e-9), (f"the coordinator received round 1's uploads (each with its own share, "
                                          f"epsilon {seen:.4g} against it) and records epsilon_coordinator {got:.4g}")
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()
