"""A hostile device that reads an honest device's data from whether a secure round is abandoned
(docs/explanation/secure-aggregation.md, "A hostile device inside a secure round"; docs/explanation/privacy.md).

In a secure round the coordinator checks the unmasked sum against the round's bounds and abandons the round when
it fails; whether a round was abandoned is public (the model does not move, ``secure_abandoned`` in the records).
The adversary is one selected device with its own kit: it runs the protocol but masks a value of its choosing,
``count x C - C/2`` on one coordinate (or, with adaptive clipping, on the clip-bit slot), so that the sum crosses
the bound exactly when an honest device's coordinate passes C/2 (or its clip bit is 1). It then reads the round
records. The victim is a canary device uploading ``C e_0`` against its zero-out neighbour uploading zeros.

The guarantee: the abandonment tells the adversary no more than the round's epsilon allows -- the central noise is
added before the sum is checked, and a round abandoned after its sum was unmasked is composed for the models'
readers too. Before the defence the round was abandoned 40 of 40 times with the canary and 0 of 40 without (and
the reverse for the clip bit): a 95% lower bound of 1.96 where the ledger composed 0.926, the true epsilon infinite.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flayer.secagg as secagg_pkg
from flayer.audit.bounds import epsilon_lower_bound
from flayer.engine.adversaries import Accounts
from flayer.engine.privacy import RoundPrivacy, privatize
from flayer.engine.secure import secure_sum
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

N, COUNT, C, Z, HOSTILE, TRIALS = 4, 6, 1.0, 4.0, "d005", 30


def _vec(v: np.ndarray) -> Update:
    return Update({"w": TensorDelta((N,), np.asarray(v, np.float32))}, 1, {})


def _abandoned(monkeypatch: Any, adaptive: bool, canary_in: bool) -> bool:
    s = PrivacySettings(enabled=True, mode="central", clip=C, noise_multiplier=Z, delta=1e-5,
                        clipping="adaptive" if adaptive else "fixed", secure_aggregation=True,
                        secure_corrupt_fraction=0.0, secure_dropout=0.0).resolve(100, COUNT)
    rp = RoundPrivacy.of(s)
    canary = np.zeros(N)
    canary[0] = 1e3 if canary_in else 0.0  # clipped to C e_0 (clip bit 0), or zeros (bit 1)
    ups = {f"d{i:03d}": privatize(_vec(canary if i == 0 else np.zeros(N)), rp, None) for i in range(COUNT)}
    real = secagg_pkg.run_round

    def hostile_round(params: Any, vectors: Any, **kw: Any) -> Any:
        ring, q = params.ring, np.zeros(params.length, dtype=np.int64)
        if adaptive:  # the bit sum passes count iff the canary's bit is 1 (4 known bits of 1, the hostile's 1.5)
            q[-1] = int(round(1.5 * ring.scale))
        else:  # coordinate 0 passes count x C iff the canary's is above C/2
            q[0] = int(round((COUNT * C - C / 2) * ring.scale))
        return real(params, {**vectors, HOSTILE: (q & np.int64(ring.modulus - 1)).astype(np.uint32)}, **kw)

    monkeypatch.setattr(secagg_pkg, "run_round", hostile_round)
    try:
        out = secure_sum(s, "fed", 1, 7, ups, None, rp=rp)
    finally:
        monkeypatch.setattr(secagg_pkg, "run_round", real)
    return out.update is None


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_abandonment_tells_no_more_than_the_rounds_epsilon(monkeypatch: Any, adaptive: bool) -> None:
    worlds = {w: np.array([float(_abandoned(monkeypatch, adaptive, w)) for _ in range(TRIALS)]) for w in (True, False)}
    s = PrivacySettings(enabled=True, clip=C, noise_multiplier=Z, secure_aggregation=True,
                        clipping="adaptive" if adaptive else "fixed", population=100).resolve(100, COUNT)
    acc = Accounts("central", True)
    acc.compose(RoundPrivacy.of(s), COUNT)
    claimed = acc.epsilons(1e-5)["public"]
    bound = epsilon_lower_bound(worlds[True], worlds[False], 1e-5, calibrate=0.3)
    assert bound.epsilon <= claimed, (f"abandoned {worlds[True].sum():.0f}/{TRIALS} with the canary, "
                                      f"{worlds[False].sum():.0f}/{TRIALS} without: bound {bound.epsilon:.3f} past the "
                                      f"ledger's {claimed:.3f}")


def test_a_round_unmasked_then_refused_is_composed_for_the_models_readers() -> None:
    """Whether it was refused was decided on its noised sum and is published: the readers' ledger counts it."""
    for mode in ("central", "local"):
        rp = RoundPrivacy(mode, 1.0, 1.0, 1.0, COUNT, ring=mode == "local")  # type: ignore[arg-type]
        acc = Accounts(mode, True)
        acc.unmasked_unfolded(rp)
        assert acc.public.rounds == 1, f"{mode}: a refused sum was not composed for the models' readers"
