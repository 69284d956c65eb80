"""A coordinator that asks the devices of a distributed-DP secure round for less noise than the privacy it states
(docs/explanation/secure-aggregation.md, "Distributed differential privacy in the ring").

In local mode a secure round's noise is drawn by the devices, in the ring, and the coordinator adds none: the
whole point is that the coordinator is not trusted with an un-noised sum. The adversary is the coordinator: it
writes the plan. It states an honest privacy mapping (local mode, z, C: what each device's own ledger and budget
count) but sets the ``secure`` mapping's ``noise_std`` -- the std each device's discrete Gaussian share is drawn
with -- to nothing (or a tiny fraction of what z C / sqrt(t) needs), so the sum it unmasks carries no noise while
every device books the round at z. The guarantee: a device refuses such a plan (opens no session, sends no key),
and takes part in the honest one.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edge_client.secure import SecureRounds
from flayer.engine.privacy import RoundPrivacy
from flayer.engine.secure import plan_round, plan_secure
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update
from protocol import Plan, SigningKey

IDS = tuple(f"dev-{i}" for i in range(6))
ME = "dev-1"


class _Device(SecureRounds):
    """The device side that reads a plan's secure round (edge_client.secure), without a broker."""

    def __init__(self) -> None:
        self.id = ME
        self.creds = SimpleNamespace(federation="fed")
        self.signer = SigningKey.generate()  # its own key (the consistency round's signatures)
        self.peers = SimpleNamespace(available=lambda: True)  # a key registry is there (its keys: not reached here)
        self.settings = SimpleNamespace(secure_corrupt_fraction=0.0)
        self.stored = SimpleNamespace(done_round=0)
        self.store = SimpleNamespace(secure_advert=lambda: None, save_secure_advert=lambda r, s: None)  # no restart
        self._secure = None
        self.sent: list[bytes] = []

    def _budget_refuses(self, plan: Any) -> bool:
        return False

    def _secure_publish(self, bodies: list[bytes], round_: int) -> None:
        self.sent.extend(bodies)


def _honest_plan() -> SimpleNamespace:
    """The plan an honest coordinator writes for a distributed-DP secure round (local mode in the ring)."""
    s = PrivacySettings(enabled=True, mode="local", clip=0.5, noise_multiplier=1.0, secure_aggregation=True)
    rp = dataclasses.replace(RoundPrivacy.of(s.resolve(100, len(IDS)), None), ring=True)
    layout = layout_of(Update({"w": TensorDelta((16,), np.zeros(16, np.float32))}, 1))
    planned = plan_round(s, "fed.1.ab", 1, IDS, layout, 7, rp, None)
    return SimpleNamespace(secure=plan_secure(planned), round=1, selected=IDS, privacy=rp.as_plan())


def _joins(plan: SimpleNamespace) -> bool:
    device = _Device()
    device._secure_plan(Plan(round=plan.round, selected=plan.selected, deadline=0.0, strategy="fedavg", options={},
                             model={}, model_digest="0" * 64, model_chunks=1, model_size=1, privacy=plan.privacy,
                             secure=plan.secure))  # the plan as a device decodes it
    return device._secure is not None and bool(device.sent)


def test_the_honest_distributed_dp_plan_is_taken():
    assert _joins(_honest_plan())


@pytest.mark.parametrize("lie", ["no noise", "a hundredth of the noise", "half the noise"])
def test_a_plan_asking_for_less_noise_than_its_privacy_states_is_refused(lie):
    plan = _honest_plan()
    honest = float(plan.secure["noise_std"])
    forged = {"no noise": 0.0, "a hundredth of the noise": honest / 100,
              "half the noise": honest / 2}[lie]
    plan.secure = dict(plan.secure, noise_std=forged)
    assert not _joins(plan), f"the device joined a round whose noise share is {forged:.3g} (z C / sqrt(t) {honest:.3g})"


def test_a_plan_stating_a_smaller_update_multiplier_than_it_books_is_refused():
    """The ledger books z (``noise_multiplier``); the noise follows ``update_multiplier``: both are checked."""
    plan = _honest_plan()
    plan.privacy = dict(plan.privacy, update_multiplier=0.01)
    plan.secure = dict(plan.secure, noise_std=plan.secure["noise_std"] * 0.01)
    assert not _joins(plan)
