"""A hostile device's huge update in a plain round (docs/explanation/guarantees.md, "Bounds on a hostile
device"; docs/explanation/security-hostile-devices.md).

The adversary is one selected device of a plain (not private, not secure) round: it holds its credentials,
the plan and the global model, and sends an update whose L2 norm is hundreds of times the federation's
``norm_bound``, built as a modified device would build it (valid wire format, finite values, the plan's
round and base model), chunk by chunk on its own update topic. The guarantee holds when, with the bound set,
the global model after the round moved by at most ``norm_bound`` whatever the adversary sent: with
``norm_policy = "reject"`` its update is refused (counter ``norm``) and the round closes with the honest
ones; with ``"clip"`` it is scaled down to the bound and folded (counter ``clipped``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from attacklib import brokerless_coordinator, open_round, upload

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from flayer.update import TensorDelta, Update
from protocol import SigningKey
from transport.credentials import Credentials

FED = "normfed"
DEVICES = ["dev-0", "dev-1", "dev-2"]
BOUND = 5.0
CREDS = Credentials(FED, "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS = {d: SigningKey.generate() for d in DEVICES}  # each device's own key, as the broker's registry holds them


def _coordinator(tmp: Path, policy: str, now: list[float]) -> tuple[Coordinator, list[Any]]:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 3", "quorum = 2",
             "over_selection = 1.5", "deadline_s = 60.0", "grace_s = 0.0", f"norm_bound = {BOUND}",
             f'norm_policy = "{policy}"', "[run]", 'strategy = "fedavg"', "rounds = 2", "seed = 3",
             "[data]", 'dataset = "digits"']
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    # no broker: what the coordinator publishes is recorded (the loop under test is the receiving side)
    cfg = load_coordinator_config(tmp / "federation.toml")
    c, plans = brokerless_coordinator(cfg, CREDS, lambda: now[0], KEYS)
    c.device_keys.path = None
    return c, plans


def _send(c: Coordinator, dev: str, plan: Any, shapes: dict[str, tuple[int, ...]], scale: float, seed: int) -> None:
    """The device's upload: a dense finite update of every tensor, chunked on its own topic."""
    rng = np.random.default_rng(seed)
    deltas = {k: TensorDelta(tuple(s), (rng.standard_normal(int(np.prod(s))) * scale).astype(np.float32))
              for k, s in sorted(shapes.items())}
    upload(c, dev, plan, Update(deltas, 50), KEYS[dev])


@pytest.mark.parametrize("policy", ["reject", "clip"])
def test_a_hostile_update_moves_the_model_at_most_the_norm_bound(tmp_path: Path, policy: str) -> None:
    now = [1000.0]
    c, plans = _coordinator(tmp_path, policy, now)
    try:
        plan = open_round(c, plans, DEVICES, now[0])
        assert set(plan.selected) == set(DEVICES)
        shapes = dict(c.open.aggregate.shapes)
        before = {k: v.clone() for k, v in c.global_state.items()}
        coordinates = sum(int(np.prod(s)) for s in shapes.values())
        _send(c, "dev-0", plan, shapes, scale=10.0, seed=9)  # norm ~ 10 sqrt(d): hundreds of bounds
        assert 10.0 * np.sqrt(coordinates) > 100 * BOUND
        _send(c, "dev-1", plan, shapes, scale=1e-4, seed=1)
        _send(c, "dev-2", plan, shapes, scale=1e-4, seed=2)
        now[0] += 61.0  # past the deadline: the round closes with what was accepted
        c._tick()
        assert c.open is None or c.open.number > plan.round
        moved = float(torch.sqrt(sum(((c.global_state[k].double() - before[k].double()) ** 2).sum()
                                     for k in before)))
        assert moved <= BOUND * (1 + 1e-5), f"the model moved {moved:g}, the bound is {BOUND}"
        assert moved > 0  # the honest updates were folded
        if policy == "reject":
            assert c.counters["norm"] == 1 and c.counters.get("clipped", 0) == 0
        else:
            assert c.counters["clipped"] == 1 and c.counters.get("norm", 0) == 0
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()
