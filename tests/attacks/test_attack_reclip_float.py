"""A hostile device against the coordinator's re-clip in floating point (docs/explanation/privacy.md, "the re-clip
to C bounds what one device can move the model by, whatever it sends"; docs/explanation/guarantees.md, "Bounds on
a hostile device").

The adversary is one selected device of a round: it holds its credentials, the plan (C in a private round; the
federation's ``norm_bound`` with ``norm_policy = "clip"`` in a plain one) and the global model's shapes. It skips
training and sends, on its own update topic in the valid wire format and signed with its own key, an upload
crafted against the arithmetic of the coordinator's intake (decode, validity gate, norm, re-clip, fold):

- ``huge``: n coordinates at 3.4e38 (finite float32, so the gate takes them), n picked so that the re-clip factor
  bound / norm is about half float32's smallest subnormal, 2^-149: a factor rounded to float32 becomes 2^-149, twice
  the factor, and the folded update's norm twice the bound;
- ``tiny``: 64 values of 1.0 followed by every other coordinate of a tensor at a value whose square is under half an
  ulp of 1.0: a float32 accumulation of the squares drops them all and takes a norm below the true one, so the
  re-clip scales the update by too little;
- ``at_bound``: the same shape scaled so that the float32 accumulation takes its norm for the bound itself: the
  gate would fold it unclipped, though its true norm is over the bound.

The guarantee holds when the upload, as the coordinator folded it into the round's sum (read before any noise is
added), has norm at most the bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attacklib import brokerless_coordinator, open_round, upload

from coordinator.config import load_coordinator_config
from flayer.update import TensorDelta, Update
from protocol import SigningKey
from transport.credentials import Credentials

FED = "floatfed"
DEVICES = ["dev-0", "dev-1", "dev-2"]
BOUND = 2.0**-14  # C of the private round, norm_bound of the plain one, 6.1e-5 (C may be as small as 1e-6)
F32_MAX = 3.4e38
CREDS = Credentials(FED, "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS = {d: SigningKey.generate() for d in DEVICES}


def _coordinator(tmp: Path, mode: str, now: list[float]) -> tuple[Any, list[Any]]:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 3", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 60.0", "grace_s = 0.0"]
    if mode == "plain":
        lines += [f"norm_bound = {BOUND}", 'norm_policy = "clip"']
    lines += ["[run]", 'strategy = "fedavg"', "rounds = 2", "seed = 3", "[data]", 'dataset = "digits"']
    if mode == "private":
        lines += ["[privacy]", "enabled = true", f"clip = {BOUND}", "noise_multiplier = 1.0", "population = 100"]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    c, plans = brokerless_coordinator(load_coordinator_config(tmp / "federation.toml"), CREDS, lambda: now[0], KEYS)
    c.device_keys.path = None
    return c, plans


def _crafted(kind: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The hostile upload: every tensor dense, the craft in the largest ones, zeros elsewhere."""
    values = {k: np.zeros(int(np.prod(s)), np.float32) for k, s in shapes.items()}
    largest = sorted(values.values(), key=lambda v: -v.size)
    if kind == "huge":
        # norm = 3.4e38 sqrt(n) with BOUND / norm = 0.51 x 2^-149
        n = int((BOUND / (0.51 * 2.0**-149 * F32_MAX)) ** 2)
        assert 1000 < n <= sum(v.size for v in values.values())
        for v in largest:
            v[:n] = F32_MAX
            n -= min(n, v.size)
    else:  # a float32 accumulation of the squares takes the norm for 8a: over the bound, or exactly the bound
        a = 1.0 if kind == "tiny" else BOUND / 8  # a power of two: every partial sum of the a^2 is exact
        largest[0][:] = a * np.sqrt(0.49 * 2.0**-23)  # each square under half an ulp of a^2
        largest[0][:64] = a
    return values


@pytest.mark.parametrize("kind", ["huge", "tiny", "at_bound"])
@pytest.mark.parametrize("mode", ["private", "plain"])
def test_a_crafted_upload_moves_the_sum_at_most_the_bound(tmp_path: Path, mode: str, kind: str) -> None:
    now = [1000.0]
    c, plans = _coordinator(tmp_path, mode, now)
    try:
        plan = open_round(c, plans, DEVICES, now[0])
        assert (plan.privacy.get("clip") == BOUND) if mode == "private" else not plan.privacy
        hostile = min(plan.selected)
        shapes = dict(c.open.aggregate.shapes)
        sent = _crafted(kind, shapes)
        upload(c, hostile, plan, Update({k: TensorDelta(tuple(shapes[k]), v) for k, v in sent.items()}, 50),
               KEYS[hostile])
        agg = c.open.aggregate.aggregator
        assert agg.contributors == 1, "the crafted upload was not folded"
        # the round's sum as folded: unweighted in a private round, weight x update in a plain one
        scale = 1.0 if mode == "private" else agg.total_weight
        moved = float(np.sqrt(sum(float(np.sum(np.square(s))) for s in agg._sum.values()))) / scale
        sent_norm = float(np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in sent.values())))
        assert sent_norm > (1e4 * BOUND if kind != "at_bound" else BOUND)  # over the bound, sent as it is
        assert moved <= BOUND, f"the crafted upload moved the round's sum by {moved / BOUND:.7f} x the bound"
        assert moved > 0.99 * BOUND  # folded at the bound, not lost
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()
