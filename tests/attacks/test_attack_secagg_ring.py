"""The ring's width (docs/explanation/secure-aggregation.md, "The ring"): a coordinator cannot state a ring in
which the honest sum wraps, and a device cannot push a masked input of another width into the sum.

Adversary 1 is the coordinator: it writes the plan every device reads (signed by it, so the device knows who
wrote it, not that it is sound). It states a ring narrower than the cohort's bounded sum needs -- the honest
sum would wrap and the round fold garbage, or be abandoned every time -- or a ring for fewer summands than it
selected, or one at another scale or resolution than the plan's own bounds give. Each device recomputes the ring
from the plan's bounds, resolution, noise and cohort and refuses any other. Adversary 2 is one selected device:
it sends a masked input at another width than the round's, or values that push the sum past the honest range.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from flayer.engine.secure import plan_round, plan_secure, secure_from_plan, sum_update
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import MaskedInput, SecAggClient, SecAggError, SecAggServer, decode_message, run_round
from flayer.update import TensorDelta, Update

IDS = tuple(f"dev-{i:02d}" for i in range(12))
SETTINGS = PrivacySettings(secure_aggregation=True)


def _update(seed: int) -> Update:
    rng = np.random.default_rng(seed)
    return Update({"w": TensorDelta((64,), rng.normal(0, 0.01, 64).astype(np.float32))}, 10)


def _honest() -> tuple[Any, dict[str, Any]]:
    lay = layout_of(_update(0))
    planned = plan_round(SETTINGS, "fed.1.ab", 1, IDS, lay, 7, None, 2.0)
    return planned, plan_secure(planned)


def test_the_honest_plan_is_taken_and_its_ring_is_narrower_than_32_bits():
    planned, raw = _honest()
    back = secure_from_plan(raw, 1, IDS)
    assert back is not None and back.params.ring == planned.params.ring
    assert raw["bits"] == planned.params.ring.bits < 32  # R = 2 at 16 bits, 12 summands: 22 bits


@pytest.mark.parametrize("lie", ["narrower", "wider", "resolution", "too_coarse", "too_fine"])
def test_a_plan_whose_ring_is_not_the_one_its_bounds_give_is_refused_by_every_device(lie):
    _, raw = _honest()
    bad = dict(raw)
    if lie == "narrower":  # the honest sum of 12 values at the edge would wrap
        bad["bits"] = raw["bits"] - 2
    elif lie == "wider":
        bad["bits"] = raw["bits"] + 1
    elif lie == "resolution":  # a coarser resolution than the width was computed for
        bad["value_bits"] = raw["value_bits"] - 4
    elif lie == "too_coarse":
        bad["value_bits"] = 7
    else:
        bad["value_bits"] = 31
    with pytest.raises(ValueError, match="ring is|value_bits"):
        secure_from_plan(bad, 1, IDS)
    for missing in ("bits", "value_bits"):  # a plan that leaves the width to the device's guess
        with pytest.raises(ValueError, match="malformed"):
            secure_from_plan({k: v for k, v in raw.items() if k != missing}, 1, IDS)


def test_a_ring_stated_beside_the_bounds_changes_nothing_the_device_computes():
    planned, raw = _honest()
    lied = {**raw, "scale": 2.0**30, "max_summands": 2, "clip_range": 1e-3}  # fields the device does not read
    back = secure_from_plan(lied, 1, IDS)
    assert back is not None and back.params.ring == planned.params.ring
    assert back.params.ring.max_summands == len(IDS)  # the cohort it was selected with, not a stated count


def test_a_masked_input_at_another_width_is_refused_by_the_coordinator():
    planned, _ = _honest()
    params = planned.params
    ups = {d: _update(i) for i, d in enumerate(IDS)}
    vectors = {d: planned.vector(ups[d], layout_of(ups[d])) for d in IDS}
    server = SecAggServer(params)
    # run the round up to the masked inputs with honest devices, then the hostile one sends 32-bit values
    clients = {d: SecAggClient(params, d) for d in IDS}
    for d in IDS:
        server.receive_advert(decode_message(clients[d].advertise().to_bytes()))
    for d in IDS:
        server.receive_shares(decode_message(clients[d].share_keys(server.key_bundle(d)).to_bytes()))
    hostile = clients[IDS[0]].masked_input(server.shares_for(IDS[0]), vectors[IDS[0]])
    wide = MaskedInput(hostile.round, hostile.device, hostile.vector, 32)  # the same values, claimed 32 bits wide
    with pytest.raises(SecAggError, match="not the round's"):
        server.receive_masked(decode_message(wide.to_bytes()))
    assert IDS[0] not in server.survivors


def test_a_device_pushing_the_sum_past_the_honest_range_gets_nothing_folded():
    planned, _ = _honest()
    params = planned.params
    ups = {d: _update(i) for i, d in enumerate(IDS)}
    lay = layout_of(ups[IDS[0]])
    vectors = {d: planned.vector(ups[d], lay) for d in IDS}
    vectors[IDS[5]] = np.full(params.length, params.ring.modulus // 2 - 1, dtype=np.uint32)  # the ring's top
    out = run_round(params, vectors, seed=b"ring-attack")
    assert out.ring_sum is not None
    total, _, why = sum_update(out.ring_sum, planned, lay, len(out.survivors))
    assert total is None and why is not None and "range" in why
