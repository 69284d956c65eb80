"""A coordinator that makes distributed noise round away (docs/explanation/secure-aggregation.md, "The ring").

In a secure round with distributed DP (local mode) each device's discrete Gaussian share is the round's only
noise. The coordinator writes the plan: here a large ``value_range`` at ``value_bits = 8``, so the ring's scale is
tiny (0.0625 a value unit), with ``noise_std`` exactly ``z C / sqrt(t)`` and the ring width those fields give. In
ring units the shares' std is far below 1, the discrete Gaussian is almost always 0, and the stochastically rounded
update of a device shows through as exact non-zero lattice points while the device books z = 1. The guarantee:
a device refuses a ring whose rounding would widen the sensitivity by more than 10% -- the same limit the
coordinator's own ring computation keeps -- and a noise share not widened for the rounding. Before the defence it
accepted the plan (a victim's sum was non-zero 976 times in 1,000, its zero neighbour's 0 times).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from flayer.engine.privacy import RoundPrivacy
from flayer.engine.secure import round_ring, secure_from_plan
from flayer.engine.secure_layout import layout_of
from flayer.update import TensorDelta, Update

IDS = tuple(f"dev-{i:02d}" for i in range(6))
RUN_SEED, ROUND, N, T = 7, 1, 4096, 4


def _plan(value_range: float, value_bits: int, noise_std: float) -> dict[str, object]:
    lay = layout_of(Update({"w": TensorDelta((N,), np.zeros(N, np.float32), None)}, 1, {}))
    return {"session": "fed.1.ab", "threshold": T, "degree": 5,
            "graph_seed": hashlib.sha256(f"secagg-graph:{RUN_SEED}:{ROUND}".encode()).hexdigest(), "length": N,
            "bits": round_ring(value_range, len(IDS), value_bits, noise_std).bits, "value_bits": value_bits,
            "layout": lay.digest, "adaptive": False, "stage_s": 10.0, "noise_std": noise_std, "bound": 1.0,
            "value_range": value_range, "corrupt_fraction": 0.0, "run_seed": RUN_SEED, "dropout": 0.1}


def test_a_ring_too_coarse_for_its_noise_is_refused() -> None:
    privacy = RoundPrivacy("local", 1.0, 1.0, 1.0, len(IDS), ring=True).as_plan()
    with pytest.raises(ValueError, match="so coarsely"):
        secure_from_plan(_plan(2048.0, 8, 1.0 / math.sqrt(T)), ROUND, IDS, 0.0, privacy)


def test_a_share_not_widened_for_the_rounding_is_refused_and_a_widened_one_taken() -> None:
    """At a fine ring (value_range 1, 16 bits) the rounding widens the sensitivity by 1 + sqrt(n) / (C s): a share of
    exactly z C / sqrt(t) is short of it; the widened one is what the coordinator states."""
    privacy = RoundPrivacy("local", 1.0, 1.0, 1.0, len(IDS), ring=True).as_plan()
    scale = round_ring(1.0, len(IDS), 16, 1.0).scale
    assert scale is not None
    bare = 1.0 / math.sqrt(T)
    with pytest.raises(ValueError, match="below the"):
        secure_from_plan(_plan(1.0, 16, bare), ROUND, IDS, 0.0, privacy)
    widened = bare * (1 + math.sqrt(N) / scale)
    for _ in range(8):  # the share's room moves the scale a little: the same fixed point the coordinator finds
        scale = round_ring(1.0, len(IDS), 16, widened).scale
        assert scale is not None
        widened = bare * (1 + math.sqrt(N) / scale)
    assert secure_from_plan(_plan(1.0, 16, widened), ROUND, IDS, 0.0, privacy) is not None
