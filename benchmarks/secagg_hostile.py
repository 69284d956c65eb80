"""How far one hostile device moves a secure round's model, against the same device in a plain round.

Ten devices, 2,000 coordinates, honest updates N(0, 0.01^2) a coordinate (norm about 0.45). One device masks a
ring vector of its choosing (every coordinate at the ring's top, one coordinate at the top, or one direction
with its norm just under the checks' allowance) instead of its encoded update; the largest shift of the mean
(L2 and one coordinate) over its crafts and ``--repeats`` fresh rounds is printed beside the plain round's (the
gate clips the same device to the round's bound). Settings: no DP with the automatic bound (10 x the median
honest norm), no DP with no federation bound (B = secure_clip_range, 8), and distributed DP (local mode in the
ring, C = 0.5, z = 1).

    python benchmarks/secagg_hostile.py --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flayer.secagg as secagg_pkg
from flayer.engine.gate import Bounds, admit
from flayer.engine.privacy import RoundPrivacy
from flayer.engine.secure import secure_sum
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

COUNT, N, HOSTILE = 10, 2000, "d09"


def craft(kind: str, params: Any, l2: float) -> np.ndarray:
    ring = params.ring
    q = np.zeros(params.length, dtype=np.int64)
    if kind == "flood":
        q[:] = ring.q_max
    elif kind == "spike":
        q[0] = min(COUNT * ring.q_max, int(l2 * ring.scale))
    else:
        q[:] = min(ring.q_max, int(l2 / math.sqrt(params.length) * ring.scale))
    return (q & np.int64(ring.modulus - 1)).astype(np.uint32)


def worst_shift(setting: str, seed: int) -> tuple[float, float, float, float]:
    """(secure L2, secure one coordinate, plain L2, plain one coordinate): the largest shifts of the mean."""
    rng = np.random.default_rng(seed)
    ups = {f"d{i:02d}": Update({"w": TensorDelta((N,), rng.normal(0, 0.01, N).astype(np.float32))}, 10)
           for i in range(COUNT)}
    norms = [float(np.linalg.norm(u.deltas["w"].values)) for u in ups.values()]
    auto, rp, clip = 10 * float(np.median(norms)), None, 0.5
    s = PrivacySettings(secure_aggregation=True)
    if setting == "auto":
        fed, bound = auto, auto
    elif setting == "none":
        fed, bound = None, 8.0
    else:
        s = PrivacySettings(enabled=True, mode="local", clip=clip, noise_multiplier=1.0, secure_aggregation=True)
        rp = dataclasses.replace(RoundPrivacy.of(s.resolve(100, COUNT), None), ring=True)
        fed, bound = None, clip
    scale = {d: min(1.0, clip / n) if rp is not None else 1.0 for d, n in zip(ups, norms)}
    honest = sum(u.deltas["w"].values.astype(np.float64) * scale[d] for d, u in ups.items() if d != HOSTILE)
    real = secagg_pkg.run_round
    best = [0.0, 0.0]
    for kind in ("flood", "spike", "stretch"):
        for l2 in (0.9 * COUNT * bound, COUNT * bound, 30 * COUNT * bound):
            def hostile(params: Any, vectors: Any, _k: str = kind, _l2: float = l2, **kw: Any) -> Any:
                return real(params, {**vectors, HOSTILE: craft(_k, params, _l2)}, **kw)

            secagg_pkg.run_round = hostile  # type: ignore[assignment]
            try:
                out = secure_sum(s, "bench", 1, seed, ups, fed, rp=rp)
            finally:
                secagg_pkg.run_round = real  # type: ignore[assignment]
            if out.update is not None:
                d = (out.update.deltas["w"].values.astype(np.float64) - honest) / COUNT
                best = [max(best[0], float(np.linalg.norm(d))), max(best[1], float(np.abs(d).max()))]
    plain = [0.0, 0.0]
    for values in (np.full(N, 8.0), np.eye(1, N, 0)[0] * 1e3):  # flood and spike, clipped by the gate
        crafted = Update({"w": TensorDelta((N,), values.astype(np.float32))}, 10)
        v = admit(crafted, float(np.linalg.norm(crafted.deltas["w"].values)), Bounds(bound, "clip"))
        assert v.update is not None
        p = v.update.deltas["w"].values.astype(np.float64) / COUNT
        plain = [max(plain[0], float(np.linalg.norm(p))), max(plain[1], float(np.abs(p).max()))]
    return best[0], best[1], plain[0], plain[1]


def clip_steering(rounds: int) -> tuple[float, float]:
    """Adaptive clipping: (C after ``rounds`` rounds in which one device pins the clip-bit sum at 0 -- its own
    bit at -(count - 1), within the [0, count] check -- while every honest device is unclipped; the largest C
    the honest mechanism reaches in as many rounds, exp(eta gamma) a round)."""
    import torch

    from coordinator.privacy import FederationPrivacy
    from flayer.engine.adversaries import Accounts
    from flayer.engine.privacy import UNCLIPPED_KEY
    from flayer.engine.round import OpenAggregate

    s = PrivacySettings(enabled=True, clipping="adaptive", clip=1.0, noise_multiplier=0.5, secure_aggregation=True,
                        population=100).resolve(100, COUNT)
    fp = FederationPrivacy(s, False, s.clip, 1, Accounts(s.mode, True))
    real = secagg_pkg.run_round

    def hostile(params: Any, vectors: Any, **kw: Any) -> Any:
        v = vectors[HOSTILE].astype(np.int64)
        v[-1] = -(COUNT - 1) * params.ring.q_max
        return real(params, {**vectors, HOSTILE: (v & np.int64(params.ring.modulus - 1)).astype(np.uint32)}, **kw)

    secagg_pkg.run_round = hostile  # type: ignore[assignment]
    try:
        for r in range(1, rounds + 1):
            rng = np.random.default_rng(r)
            ups = {f"d{i:02d}": Update({"w": TensorDelta((200,), rng.normal(0, 0.01, 200).astype(np.float32))}, 10,
                                       {UNCLIPPED_KEY: 1.0}) for i in range(COUNT)}
            rp = fp.round(COUNT)
            agg = OpenAggregate(None, {"w": torch.zeros(200)}, rp)  # type: ignore[arg-type]
            out = secure_sum(s, "bench", r, 0, ups, None, None, rp)
            if out.update is not None:
                agg.fold_sum(out.update, len(out.survivors), out.bits)
            fp.close(agg)
    finally:
        secagg_pkg.run_round = real  # type: ignore[assignment]
    return fp.clip, math.exp(s.clip_lr * s.target_quantile * rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'setting':<22} {'secure L2':>10} {'secure coord':>13} {'plain L2':>9} {'plain coord':>12} {'ratio L2':>9}")
    for setting, label in (("auto", "no DP, automatic B"), ("none", "no DP, no fed. bound"),
                           ("dp", "distributed DP C=0.5")):
        rows = [worst_shift(setting, seed) for seed in range(args.repeats)]
        w = [max(r[i] for r in rows) for i in range(4)]
        print(f"{label:<22} {w[0]:>10.4f} {w[1]:>13.4f} {w[2]:>9.4f} {w[3]:>12.4f} {w[0] / w[2]:>9.2f}")
    clip, most = clip_steering(12)
    print(f"adaptive clipping, one device pinning the clip-bit sum at 0 for 12 rounds: C 1.0 -> {clip:.3f} "
          f"(the honest mechanism's largest: {most:.3f})")


if __name__ == "__main__":
    main()
