"""Reading the honest devices' un-noised sum out of a secure round's abandon reason (docs/reference/private-fields.md;
docs/explanation/secure-aggregation.md, "A hostile device inside a secure round").

In a secure round with central noise the coordinator unmasks the sum of the clipped updates and only then adds
the noise; a sum that breaks the round's bounds is refused and the round abandoned, with the reason in the log
and in the round record (``secure_abandoned``: metrics.jsonl, ``flayer status``, the dashboard). The adversary
is a device inside the round that masks an out-of-range value on purpose, together with whoever reads those
records. It knows its own input, so any figure of the refused sum the reason quotes -- a coordinate's value, the
norm -- is a figure of the honest devices' sum, without noise.

Run on the protocol code the coordinator runs (:func:`flayer.engine.secure.secure_sum`). The guarantee: the
reason is the same whatever the honest devices' updates are, so reading it tells the adversary nothing of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flayer.secagg as secagg_pkg
from flayer.engine.privacy import RoundPrivacy
from flayer.engine.secure import secure_sum
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

COUNT, N, HOSTILE = 6, 100, "d05"


def _uploads(seed: int) -> dict[str, Update]:
    rng = np.random.default_rng(seed)
    return {f"d{i:02d}": Update({"w": TensorDelta((N,), rng.normal(0, 0.02, N).astype(np.float32))}, 1, {})
            for i in range(COUNT)}


def _hostile(monkeypatch: Any, how: str) -> None:
    real = secagg_pkg.run_round

    def hostile_round(params: Any, vectors: Any, **kw: Any) -> Any:
        v = vectors[HOSTILE].astype(np.int64)
        if how == "ring":  # one coordinate past what count inputs can reach
            v[0] = (COUNT + 2) * params.ring.q_max
        else:  # every coordinate at the range's edge: the norm, sqrt(N) x C, past count x C
            v[:] = params.ring.q_max
        return real(params, {**vectors, HOSTILE: (v & np.int64(params.ring.modulus - 1)).astype(np.uint32)}, **kw)

    monkeypatch.setattr(secagg_pkg, "run_round", hostile_round)


def _reason(seed: int) -> str:
    # the sum is checked after the central noise is added (flayer.engine.secure.sum_update): at z 0.05 the noise
    # leaves room to refuse the hostile input, so there is a reason to read
    s = PrivacySettings(enabled=True, clip=1.0, noise_multiplier=0.05, secure_aggregation=True,
                        population=100).resolve(100, COUNT)
    out = secure_sum(s, "fed", 1, 0, _uploads(seed), None, None, RoundPrivacy.of(s))
    assert out.update is None and out.reason, "the hostile input was folded"
    return out.reason


@pytest.mark.parametrize("how", ["ring", "norm"])
def test_an_abandon_reason_quotes_nothing_of_the_honest_sum(monkeypatch: Any, how: str) -> None:
    _hostile(monkeypatch, how)
    reasons = {_reason(seed) for seed in (1, 2, 3)}
    assert len(reasons) == 1, (f"the abandon reason changes with the honest devices' updates, so it carries their "
                               f"un-noised sum: {sorted(reasons)}")
