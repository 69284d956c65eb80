"""A hostile device against per-layer clip bounds (docs/explanation/privacy.md, "Per-layer clip bounds";
docs/explanation/guarantees.md).

With ``[privacy] clip_split = "sqrt"`` or ``"equal"`` an honest device clips each layer i of its upload to its own
bound C_i, with sum_i C_i^2 = C^2, so its clipped upload's norm is at most C and the accountant's sensitivity is
unchanged. The adversary is one selected device of a private round (central noise): it holds its credentials,
the plan (C, the split, m) and the global model, and skips the clip. It sends, on its own update topic in the
valid wire format, the upload that would take the most from per-layer bounds read as separate allowances: every
layer far above its C_i, in the direction whose per-layer clip is ``C_i`` on each layer -- the vector a coordinator
that bounded each layer at C_i but nothing else, or the whole at sum_i C_i, would fold in full (sum_i C_i exceeds
C whenever there are two layers or more). It then reads what every device reads: the next global model. The
guarantee: the round's sum moved by at most C along that direction (up to the round's own noise, z C on a unit
direction of the sum), the same sensitivity as with one bound on the whole upload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attacklib import brokerless_coordinator, open_round, upload

from coordinator.config import load_coordinator_config
from flayer.engine.privacy import layer_bounds, layer_of
from flayer.privacy_config import auto_server_lr
from flayer.update import TensorDelta, Update
from protocol import SigningKey
from transport.credentials import Credentials

FED = "layerfed"
DEVICES = ["dev-0", "dev-1", "dev-2"]
C, Z = 0.3, 0.05  # a small z: the noise along one direction of the sum is z C = 0.015, a twentieth of C
CREDS = Credentials(FED, "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS = {d: SigningKey.generate() for d in DEVICES}


def _coordinator(tmp: Path, split: str, now: list[float]) -> tuple[Any, list[Any]]:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 3", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 60.0", "grace_s = 0.0",
             "[run]", 'strategy = "fedavg"', "rounds = 2", "seed = 3", "[data]", 'dataset = "digits"',
             "[privacy]", "enabled = true", f"clip = {C}", f"noise_multiplier = {Z}", f'clip_split = "{split}"',
             "population = 100"]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    c, plans = brokerless_coordinator(load_coordinator_config(tmp / "federation.toml"), CREDS, lambda: now[0], KEYS)
    c.device_keys.path = None
    return c, plans


def _send(c: Any, dev: str, plan: Any, deltas: dict[str, np.ndarray]) -> None:
    """The device's upload, dense, chunked on its own topic and signed with its own key."""
    up = Update({k: TensorDelta(v.shape, v.reshape(-1).astype(np.float32)) for k, v in deltas.items()}, 50)
    upload(c, dev, plan, up, KEYS[dev])


@pytest.mark.parametrize("split", ["sqrt", "equal"])
def test_a_hostile_upload_moves_the_sum_at_most_c_under_per_layer_bounds(tmp_path: Path, split: str) -> None:
    now = [1000.0]
    c, plans = _coordinator(tmp_path, split, now)
    try:
        plan = open_round(c, plans, DEVICES, now[0])
        assert plan.privacy.get("clip_split") == split and len(plan.selected) >= 2
        hostile, *honest = sorted(plan.selected)
        m = int(plan.privacy["contributions"])
        shapes = dict(c.open.aggregate.shapes)
        before = {k: v.clone() for k, v in c.global_state.items()}
        # the direction whose per-layer clip gives every layer exactly its C_i (public: the split is in the plan)
        rng = np.random.default_rng(7)
        raw = {k: rng.standard_normal(int(np.prod(s))) for k, s in sorted(shapes.items())}
        probe = Update({k: TensorDelta(tuple(shapes[k]), v.astype(np.float32)) for k, v in raw.items()}, 1)
        bounds = layer_bounds(probe, C, split)
        assert len(bounds) >= 2 and sum(bounds.values()) > 1.3 * C  # an L1 reading would fold well above C
        norms = {layer: np.sqrt(sum(float(v @ v) for k, v in raw.items() if layer_of(k) == layer)) for layer in bounds}
        u = {k: v * bounds[layer_of(k)] / norms[layer_of(k)] for k, v in raw.items()}  # norm C, C_i a layer
        _send(c, hostile, plan, {k: (1e4 * v).reshape(shapes[k]) for k, v in u.items()})  # unclipped: 1e4 C
        for i, d in enumerate(honest):  # the others send almost nothing
            _send(c, d, plan, {k: (1e-7 * np.random.default_rng(i).standard_normal(int(np.prod(s)))).reshape(s)
                               for k, s in shapes.items()})
        now[0] += 61.0
        c._tick()
        assert c.open is None or c.open.number > plan.round
        # what the adversary reads: the next model, prev + eta (sum + noise) / m, with eta the server step the
        # public rule gives (server_lr "auto" from z, C and m); m / eta times its move along u / C is the hostile
        # share of the sum
        eta = auto_server_lr(Z, C, m)
        along = sum(float(((c.global_state[k].double() - before[k].double()).numpy().reshape(-1) * u[k]).sum())
                    for k in u) * m / (eta * C)
        assert along <= C + 5 * Z * C, (f"the hostile upload moved the round's sum by {along:.4f} along its direction, "
                                        f"C is {C} (the L1 reading of the layer bounds: {sum(bounds.values()):.4f})")
        assert along > C - 5 * Z * C  # it was folded, clipped to C (not refused, not lost)
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()
