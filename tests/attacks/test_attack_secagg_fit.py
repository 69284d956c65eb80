"""A secure round fitted to the link, attacked (docs/explanation/secure-aggregation.md, "Fitted to the link").

The keep fraction and the kept positions are public: every device recomputes the subset from the run seed and the
round, so what the coordinator states can only be that subset.

* a plan whose keep fraction is outside [0.01, 1] (or not a number) -- refused by the devices;
* a plan stating a keep fraction but a layout of the coordinator's choosing (another subset: say, positions it
  picked to single out coordinates, or the full layout with a short length) -- the device's kept layout does
  not match the plan's digest: it masks nothing and sends nothing;
* a device that masks all the common positions in a round that keeps a share of them (a masked input of
  another length) -- refused by the server, counted as dropped; the others' sum is unmasked.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.secure import SecureSession
from flayer.engine import secure_fit as sf
from flayer.engine.secure import plan_round, plan_secure, secure_from_plan
from flayer.engine.secure_layout import Layout, flatten, layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import SecAggError, run_round
from flayer.secagg.client import SecAggClient
from flayer.secagg.msg_unmask import MaskedInput
from flayer.update import TensorDelta, Update

IDS = tuple(f"dev-{i:02d}" for i in range(6))
S = PrivacySettings(secure_aggregation=True, secure_value_bits=28)


def _upload(rng: np.random.Generator) -> Update:
    idx = np.arange(0, 800, 2, dtype=np.int64)
    return Update({"a.weight": TensorDelta((20, 30), rng.normal(0, 0.01, 600).astype(np.float32)),
                   "b.weight": TensorDelta((800,), rng.normal(0, 0.01, 400).astype(np.float32), idx)}, 1, {})


def _raw(keep: float = 0.4) -> tuple[dict[str, object], Layout]:
    up = _upload(np.random.default_rng(0))
    planned = plan_round(S, "fed.1.ab", 1, IDS, layout_of(up), 7, None, None, keep=keep)
    return plan_secure(planned), layout_of(up)


@pytest.mark.parametrize("keep", [0.0, 0.001, 1.5, float("nan"), "all", True])
def test_a_plan_whose_keep_fraction_is_outside_its_range_is_refused(keep):
    raw, _ = _raw()
    assert secure_from_plan(raw, 1, IDS) is not None
    with pytest.raises(ValueError, match="keep fraction"):
        secure_from_plan({**raw, "keep": keep}, 1, IDS)


def _session(raw: dict[str, object]) -> SecureSession:
    planned = secure_from_plan(raw, 1, IDS)
    assert planned is not None
    sess = SecureSession(planned, IDS[0], None)
    sess.update = _upload(np.random.default_rng(1))
    sess.shares = object()  # type: ignore[assignment]  # the layout is checked before the shares are used
    return sess


def test_a_plan_stating_a_subset_other_than_the_run_seeds_is_refused_by_the_device():
    raw, full = _raw(0.4)
    honest = secure_from_plan(raw, 1, IDS)
    assert honest is not None and layout_of(honest.fitted(_upload(np.random.default_rng(1)))).digest == raw["layout"]
    chosen = Layout(full.names, full.shapes, (np.arange(240, dtype=np.int64), np.arange(0, 320, 2, dtype=np.int64)))
    assert chosen.n == sf.keep_layout(full, 0.4, 7, 1).n  # the same count, the coordinator's own positions
    for layout in (chosen, full):  # its own subset; every position under a keep fraction of 0.4
        sess = _session({**raw, "layout": layout.digest, "length": layout.n})
        with pytest.raises(SecAggError, match="keep fraction"):
            sess.masked_blob()
        assert sess.masked_sent is False
    # a subset drawn from another run seed than the plan's: not the one this device draws
    other, _ = _raw(0.4)
    with pytest.raises(SecAggError, match="not the round's layout"):
        _session({**other, "layout": sf.keep_layout(full, 0.4, 8, 1).digest}).masked_blob()


def test_a_masked_input_of_every_common_position_in_a_fitted_round_is_refused_and_the_rest_is_summed(monkeypatch):
    raw, full = _raw(0.4)
    planned = secure_from_plan(raw, 1, IDS)
    assert planned is not None
    kept = sf.keep_layout(full, 0.4, 7, 1)
    rng = np.random.default_rng(3)
    ups = {d: _upload(rng) for d in IDS}
    vectors = {d: planned.vector(planned.fitted(u), kept, np.random.default_rng(0)) for d, u in ups.items()}
    honest = SecAggClient.masked_input

    def hostile(self, shares, vector):  # dev-03 masks its whole upload, a longer vector than the round's
        out = honest(self, shares, vector)
        if self.device != "dev-03":
            return out
        return MaskedInput(out.round, out.device, np.zeros(full.n, dtype=np.uint32), out.bits)

    monkeypatch.setattr(SecAggClient, "masked_input", hostile)
    out = run_round(planned.params, vectors, seed=bytes(32))
    assert "dev-03" in out.refusals and f"has {full.n} values, not {kept.n}" in out.refusals["dev-03"]
    assert out.abandoned_reason is None and out.ring_sum is not None and "dev-03" not in out.survivors
    from flayer.secagg import decode_sum

    total = decode_sum(out.ring_sum, planned.params.ring, len(out.survivors))
    plain = sum(flatten(planned.fitted(ups[d]), kept) for d in out.survivors)
    assert np.abs(total - plain).max() < 1e-5
