"""One hostile device inside a secure round (docs/explanation/secure-aggregation.md, "What a hostile device
can still do").

The adversary is one selected device. It sees what every device sees -- the round's public parameters (the
ring: its range and scale) -- and controls only its own masked input: it runs the protocol honestly but masks
a ring vector of its choosing instead of its clipped, quantised update (a modified client; masking validates
nothing). It tries the crafts that served it best against the old checks: every coordinate at the ring's top
("flood"), one coordinate at the top ("spike"), and a vector along one direction whose norm sits just under
the old L2 allowance ("stretch"). What it achieves is its shift of the round's sum, divided by the count the
sum is averaged over: the model shift.

The guarantee: a secure round folds nothing that moves the model further than ``B + ||H|| / count`` in L2 and
``R + max|H_i| / count`` in any coordinate (B the contribution bound every device clips to, R the per-coordinate
range, H the honest devices' sum), plus the rounding and noise allowances the checks grant. Against the same
device in a plain round with the same bound the gate clips it to B, a shift of ``B / count``: the residual of a
secure round is ``count`` times that, and the docs state it. Without the bound (old code, no DP) the flood moved
every coordinate by R = 8; with distributed DP the stretch passed with an L2 many times count x C.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

import flayer.secagg as secagg_pkg
from flayer.engine.gate import Bounds, admit
from flayer.engine.privacy import RoundPrivacy
from flayer.engine.secure import secure_sum
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

COUNT, N = 10, 2000
HOSTILE = "d09"


def _uploads(seed: int) -> dict[str, Update]:
    rng = np.random.default_rng(seed)
    return {f"d{i:02d}": Update({"w": TensorDelta((N,), rng.normal(0, 0.01, N).astype(np.float32))}, 10)
            for i in range(COUNT)}


def _craft(kind: str, params: Any, old_l2: float) -> np.ndarray:
    """The hostile device's ring vector: what it masks instead of its encoded update."""
    ring = params.ring
    top = ring.q_max  # the largest |q| a value may take: the adversary reads it off the plan
    q = np.zeros(params.length, dtype=np.int64)
    if kind == "flood":
        q[:] = top
    elif kind == "spike":
        q[0] = min(COUNT * top, int(old_l2 * ring.scale))  # within the old per-coordinate check
    else:  # stretch: along (1, 1, ...), norm just under the old L2 allowance, each coordinate within the ring
        q[:] = min(top, int(old_l2 / math.sqrt(params.length) * ring.scale))
    return (q & np.int64(ring.modulus - 1)).astype(np.uint32)


def _attack(monkeypatch: pytest.MonkeyPatch, kind: str, old_l2: float) -> None:
    real = secagg_pkg.run_round

    def hostile_round(params: Any, vectors: Any, **kw: Any) -> Any:
        vectors = dict(vectors)
        vectors[HOSTILE] = _craft(kind, params, old_l2)
        return real(params, vectors, **kw)

    monkeypatch.setattr(secagg_pkg, "run_round", hostile_round)


def _shift(out: Any, honest: np.ndarray, denominator: int) -> tuple[float, float]:
    total = out.update.deltas["w"].values.astype(np.float64)
    d = (total - honest) / denominator
    return float(np.linalg.norm(d)), float(np.abs(d).max())


def _plain_shift(ups: dict[str, Update], bound: float) -> tuple[float, float]:
    """The same device in a plain round: its crafted update (every coordinate at 8) through the gate's bound."""
    crafted = Update({"w": TensorDelta((N,), np.full(N, 8.0, np.float32))}, 10)
    v = admit(crafted, float(np.linalg.norm(crafted.deltas["w"].values)), Bounds(bound, "clip"))
    assert v.update is not None
    d = v.update.deltas["w"].values.astype(np.float64) / len(ups)
    return float(np.linalg.norm(d)), float(np.abs(d).max())


@pytest.mark.parametrize("automatic", [True, False])
def test_a_hostile_device_moves_a_round_without_dp_no_further_than_the_bound(monkeypatch, automatic):
    """``automatic``: the coordinator's automatic norm bound (10 x the median accepted norm) is the round's B;
    else no federation bound is known (``flayer simulate``) and B is ``secure_clip_range`` (8)."""
    ups = _uploads(1)
    norms = [float(np.linalg.norm(u.deltas["w"].values)) for u in ups.values()]
    auto = 10 * float(np.median(norms))
    bound = auto if automatic else 8.0
    honest = sum(u.deltas["w"].values.astype(np.float64) for d, u in ups.items() if d != HOSTILE)
    plain_l2, _ = _plain_shift(ups, bound)
    worst = (0.0, 0.0)
    for kind in ("flood", "spike", "stretch"):
        _attack(monkeypatch, kind, COUNT * bound * 0.99)
        out = secure_sum(PrivacySettings(secure_aggregation=True), "t", 1, 0, ups, auto if automatic else None)
        if out.update is not None:
            l2, coord = _shift(out, honest, COUNT)
            worst = (max(worst[0], l2), max(worst[1], coord))
    h = np.linalg.norm(honest) / COUNT
    assert worst[0] <= bound + h + 1e-3, f"one device moved the model by L2 {worst[0]:.3f} (bound {bound:.3f})"
    assert worst[1] <= bound + np.abs(honest).max() / COUNT + 1e-3, f"one coordinate moved by {worst[1]:.3f}"
    assert plain_l2 <= bound / COUNT + 1e-6 and worst[0] <= COUNT * plain_l2 + h + 1e-3


def test_a_hostile_device_moves_a_round_with_distributed_dp_no_further_than_clip_and_noise(monkeypatch):
    ups = _uploads(2)
    clip = 0.5
    s = PrivacySettings(enabled=True, mode="local", clip=clip, noise_multiplier=1.0, secure_aggregation=True)
    rp = dataclasses.replace(RoundPrivacy.of(s.resolve(100, COUNT), None), ring=True)
    honest = sum(u.deltas["w"].values.astype(np.float64) * min(1.0, clip / float(np.linalg.norm(u.deltas["w"].values)))
                 for d, u in ups.items() if d != HOSTILE)
    sigma_sum = rp.sum_std * 1.2  # the sum's noise std: (z C) widened for rounding and >= t survivors
    old_l2 = COUNT * (clip + 2.0 * sigma_sum * math.sqrt(N))  # the old check's allowance: count x (C + 2 sigma sqrt n)
    worst = (0.0, 0.0)
    for kind in ("flood", "spike", "stretch"):
        _attack(monkeypatch, kind, old_l2 * 0.9)
        out = secure_sum(s, "t", 1, 0, ups, None, rp=rp)
        if out.update is not None:
            l2, coord = _shift(out, honest, COUNT)
            worst = (max(worst[0], l2), max(worst[1], coord))
    noise_l2 = 2.0 * sigma_sum * (math.sqrt(N) + 6)  # the noise's own norm (with margin) and the check's allowance
    assert worst[0] <= (COUNT * clip + noise_l2 + np.linalg.norm(honest)) / COUNT, \
        f"one device moved the model by L2 {worst[0]:.3f} (C = {clip})"
    assert worst[1] <= clip + (9 + 6) * sigma_sum / COUNT * 2 + np.abs(honest).max() / COUNT
