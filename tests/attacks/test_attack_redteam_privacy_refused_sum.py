"""Sums the coordinator unmasks and then refuses, left out of its epsilon (docs/explanation/privacy.md, "Who
learns what": local mode with secure aggregation, the figure against the coordinator).

With distributed DP the coordinator is an adversary covered by the devices' noise shares: it learns only the
sums it unmasks. A secure round whose unmasked sum breaks the round's bounds (a hostile device masked values
outside them) is refused: the model stays, so readers of the models learn nothing of it -- but the coordinator
(and the broker operator, which relays the masked inputs and the unmasking shares) has unmasked that sum. The
adversary here is a device inside the round that does this every round, and the coordinator that keeps each
noised sum it unmasked. The rounds run on the protocol code the coordinator runs
(:func:`flayer.engine.secure.secure_sum`) and close through the coordinator's own secure-round close
(:meth:`coordinator.secure_phase.SecurePhase.close`, then :meth:`coordinator.privacy.FederationPrivacy.close`).
The guarantee: the ``epsilon_coordinator`` the federation records composes every sum the coordinator unmasked,
folded or not.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import flayer.secagg as secagg_pkg
from coordinator.privacy import FederationPrivacy
from coordinator.secure_phase import SecurePhase
from flayer.engine.accountant import epsilon_for
from flayer.engine.adversaries import Accounts
from flayer.engine.round import OpenAggregate
from flayer.engine.secure import secure_sum
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

COUNT, N, HOSTILE, ROUNDS, Z = 6, 50, "d05", 3, 4.0


def _uploads(seed: int) -> dict[str, Update]:
    rng = np.random.default_rng(seed)
    return {f"d{i:02d}": Update({"w": TensorDelta((N,), rng.normal(0, 0.02, N).astype(np.float32))}, 1, {})
            for i in range(COUNT)}


def _hostile(monkeypatch: Any) -> None:
    real = secagg_pkg.run_round

    def hostile_round(params: Any, vectors: Any, **kw: Any) -> Any:
        v = vectors[HOSTILE].astype(np.int64)
        v[:] = params.ring.q_max  # every coordinate at its range's edge: the sum's norm breaks count x C
        return real(params, {**vectors, HOSTILE: (v & np.int64(params.ring.modulus - 1)).astype(np.uint32)}, **kw)

    monkeypatch.setattr(secagg_pkg, "run_round", hostile_round)


def test_every_sum_the_coordinator_unmasked_is_in_its_epsilon(monkeypatch: Any) -> None:
    _hostile(monkeypatch)
    s = PrivacySettings(enabled=True, mode="local", clip=1.0, noise_multiplier=Z, secure_aggregation=True,
                        population=100).resolve(100, COUNT)
    fp = FederationPrivacy(s, False, s.clip, 1, Accounts(s.mode, True))
    records: list[dict[str, Any]] = []
    unmasked = 0
    for r in range(1, ROUNDS + 1):
        rp = fp.round(COUNT)
        rp = type(rp)(**{**rp.__dict__, "ring": True})  # local mode in a secure round: shares in the ring
        agg = OpenAggregate(None, {"w": torch.zeros(N)}, rp)  # type: ignore[arg-type]
        out = secure_sum(s, "fed", r, 0, _uploads(r), None, None, rp)
        assert out.update is None and out.reason and "unmasked sum" in out.reason
        unmasked += 1  # the coordinator decoded this sum before refusing it
        rnd = SimpleNamespace(number=r, aggregate=agg, stats=SimpleNamespace(extra={}),
                              secure=SimpleNamespace(server=SimpleNamespace(faulty={}, asked=True), sent_bytes=0,
                                                 consent_asked=True))  # the sum was unmasked: consent was asked
        ctx = SimpleNamespace(privacy=fp, counters={"secure_abandoned": 0},
                              cfg=SimpleNamespace(run=SimpleNamespace(privacy=s), federation=SimpleNamespace(norm_bound=None, deadline_s=60.0)))
        SecurePhase(ctx).close(rnd, out)  # type: ignore[arg-type]  # the reason the round closes with
        records.append(fp.close(rnd.aggregate))  # the round's close composes its privacy
    seen = epsilon_for([(Z, 1.0, unmasked)], fp.delta)
    got = records[-1]["epsilon_coordinator"]
    got = float("inf") if got == "inf" else float(got)
    assert got >= seen * (1 - 1e-9), (f"the coordinator unmasked {unmasked} noised sums (epsilon {seen:.4g} at z {Z}); "
                                      f"the federation records epsilon_coordinator {got:.4g} against it")
