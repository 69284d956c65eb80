"""Steering adaptive clipping from inside a secure round (docs/explanation/secure-aggregation.md, "What a
hostile device can still do").

With adaptive clipping each device's clip bit (1: its update was within C) rides as one more coordinate of its
masked input, so the coordinator sees only the bits' sum and moves C by it (Andrew et al. 2021). The adversary
is one selected device: it runs the protocol honestly but masks a clip-bit coordinate of its choosing (any ring
value: masking validates nothing) -- so far below zero that the bits' sum sits at ``-count x R``, the ring's
limit, to make C grow round after round although every honest device is unclipped (which shrinks C). It also profits from rounds that fold nothing: a round abandoned, or
refused, that still moves C moves it as if nobody had been within C.

The guarantee: the attack moves C no more than a clip bit inside the range can -- at most the factor
``exp(eta max(gamma, 1 - gamma))`` a round, the residual the docs state (inside ``[0, count]`` one device can
already pull the estimate anywhere in [0, 1]) -- and costs the honest devices no round. The clip-bit count is
noised before anything looks at it and is not range-checked (a check of the un-noised count would publish
whether an honest device's bit passed a threshold the hostile device set: a round abandoned or not); ``next_clip``
keeps the estimate in [0, 1]. C moves only after a round that folded a sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

import flayer.secagg as secagg_pkg
from coordinator.privacy import FederationPrivacy
from flayer.engine.adversaries import Accounts
from flayer.engine.privacy import UNCLIPPED_KEY
from flayer.engine.round import OpenAggregate
from flayer.engine.secure import secure_sum
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

COUNT, N, HOSTILE, ROUNDS = 10, 200, "d09", 12


def _uploads(seed: int) -> dict[str, Update]:
    rng = np.random.default_rng(seed)  # norms about 0.14, far within C = 1: every honest bit is 1
    return {f"d{i:02d}": Update({"w": TensorDelta((N,), rng.normal(0, 0.01, N).astype(np.float32))}, 10,
                                {UNCLIPPED_KEY: 1.0}) for i in range(COUNT)}


def _hostile(monkeypatch: Any) -> None:
    real = secagg_pkg.run_round

    def hostile_round(params: Any, vectors: Any, **kw: Any) -> Any:
        v = vectors[HOSTILE].astype(np.int64)
        v[-1] = -(2 * COUNT - 1) * params.ring.q_max  # its clip bit: the sum at -count x R, the ring's limit
        return real(params, {**vectors, HOSTILE: (v & np.int64(params.ring.modulus - 1)).astype(np.uint32)}, **kw)

    monkeypatch.setattr(secagg_pkg, "run_round", hostile_round)


def _federation() -> tuple[PrivacySettings, FederationPrivacy]:
    s = PrivacySettings(enabled=True, clipping="adaptive", clip=1.0, noise_multiplier=0.5, secure_aggregation=True,
                        population=100).resolve(100, COUNT)
    return s, FederationPrivacy(s, False, s.clip, 1, Accounts(s.mode, True))


def _round(s: PrivacySettings, fp: FederationPrivacy, r: int, ups: dict[str, Update],
           drops: dict[str, str] | None = None) -> bool:
    """One secure round as the coordinator runs it: the sum, folded (or not), then the privacy close."""
    rp = fp.round(COUNT)
    agg = OpenAggregate(None, {"w": torch.zeros(N)}, rp)  # type: ignore[arg-type]
    out = secure_sum(s, "fed", r, 0, ups, None, drops, rp)
    if out.update is not None:
        agg.fold_sum(out.update, len(out.survivors), out.bits, out.noised)
    fp.close(agg)
    return out.update is not None


def test_a_clip_bit_sum_below_zero_moves_c_no_more_than_the_residual(monkeypatch):
    s, honest = _federation()
    for r in range(1, ROUNDS + 1):
        assert _round(s, honest, r, _uploads(r))
    assert honest.clip < 1.0  # every bit 1: C shrinks towards the target quantile
    _hostile(monkeypatch)
    s, attacked = _federation()
    step = float(np.exp(s.clip_lr * max(s.target_quantile, 1 - s.target_quantile)))
    clips = [attacked.clip]
    folded = []
    for r in range(1, ROUNDS + 1):
        folded.append(_round(s, attacked, r, _uploads(r)))
        clips.append(attacked.clip)
    assert all(folded), "the honest devices lost a round to one device's clip bit"
    worst = max(b / a for a, b in zip(clips, clips[1:]))
    assert worst <= step * (1 + 1e-9), f"one round moved C by x{worst:.4f}, past the residual x{step:.4f}"


def test_a_round_that_folds_nothing_leaves_c_where_it_was():
    s, fp = _federation()
    ups = _uploads(1)
    drops = {d: "after_keys" for d in list(ups)[2:]}  # 2 of 10 left: fewer than t, abandoned
    assert not _round(s, fp, 1, ups, drops)
    assert fp.clip == 1.0, f"an abandoned round moved C to {fp.clip:.4f}"
    assert dataclasses.replace(fp).clip == 1.0
