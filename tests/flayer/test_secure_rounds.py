"""Secure rounds in the round engine (docs/explanation/secure-aggregation.md): the common layout, the sum the
coordinator folds equals the plain fixed-denominator sum, dropouts and abandoned rounds, a device that masks
values past its clip, and the simulator driving the same protocol code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flayer.config import TrainConfig
from flayer.engine.privacy import private_strategy
from flayer.engine.secure import check_sum, common_layout, drops_for, secure_sum
from flayer.engine.secure_layout import flatten, layout_of, unflatten
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data
from flayer.update import TensorDelta, Update

TRAIN = TrainConfig(lr=0.05, batch_size=10, device="cpu")
SECURE = PrivacySettings(secure_aggregation=True)
FINE = PrivacySettings(secure_aggregation=True, secure_value_bits=28)  # a ring fine enough to compare with the clear


def _upload(rng: np.random.Generator, scale: float = 0.01, idx: np.ndarray | None = None) -> Update:
    idx = np.array([1, 4, 7], dtype=np.int64) if idx is None else idx
    return Update({"a.weight": TensorDelta((2, 3), (rng.normal(0, scale, 6)).astype(np.float32)),
                   "b.weight": TensorDelta((10,), (rng.normal(0, scale, idx.size)).astype(np.float32), idx)}, 20,
                  {"test_correct": 3.0, "test_total": 5.0})


def test_the_layout_flattens_and_comes_back_and_its_digest_names_the_positions():
    up = _upload(np.random.default_rng(0))
    lay = layout_of(up)
    assert lay.n == 9 and lay.names == ("a.weight", "b.weight")
    back = unflatten(flatten(up, lay), lay, 1)
    assert all(np.array_equal(back.deltas[k].values, up.deltas[k].values) for k in up.deltas)
    assert np.array_equal(back.deltas["b.weight"].indices, up.deltas["b.weight"].indices)
    other = _upload(np.random.default_rng(0), idx=np.array([1, 4, 8], dtype=np.int64))
    assert layout_of(other).digest != lay.digest
    with pytest.raises(ValueError, match="common layout"):
        flatten(other, lay)
    with pytest.raises(ValueError, match="device d1's upload positions differ"):
        common_layout({"d0": up, "d1": other})


def test_the_unmasked_sum_is_the_plain_sum_of_the_survivors_within_the_rounding():
    rng = np.random.default_rng(1)
    ups = {f"d{i}": _upload(rng) for i in range(6)}
    out = secure_sum(SECURE, "t", 3, 7, ups, None)
    assert out.reason is None and out.survivors == tuple(sorted(ups)) and out.update is not None
    from flayer.engine.secure import round_params

    ring = round_params(SECURE, "t", 3, tuple(sorted(ups)), layout_of(ups["d0"]), 7)[0].ring
    assert ring.scale == 2.0**12 and ring.bits == 1 + (6 * 2**15).bit_length() + 1  # R = 8 at 16 bits, 6 summands
    for name in ("a.weight", "b.weight"):
        plain = sum(u.deltas[name].values.astype(np.float64) for u in ups.values())
        # stochastic rounding: each summand within 1/scale of its value (flayer.secagg.ring)
        assert np.abs(out.update.deltas[name].values - plain).max() < 6 / ring.scale
    assert all(b > 0 for b in out.bytes_per_device.values()) and set(out.messages_per_device) == set(ups)


def test_dropouts_leave_the_survivors_sum_and_too_few_abandon_the_round():
    rng = np.random.default_rng(2)
    ups = {f"d{i}": _upload(rng) for i in range(8)}
    out = secure_sum(SECURE, "t", 1, 0, ups, None, {"d2": "after_shares", "d5": "after_keys"})
    assert out.reason is None and out.dropped == ("d2", "d5") and out.update is not None
    plain = sum(u.deltas["a.weight"].values.astype(np.float64) for d, u in ups.items() if d not in ("d2", "d5"))
    assert np.abs(out.update.deltas["a.weight"].values - plain).max() < 6 / 2.0**12  # 6 summands, R = 8 at 16 bits
    few = secure_sum(SECURE, "t", 1, 0, {d: ups[d] for d in ("d0", "d1", "d2")}, None, {"d1": "after_shares"})
    assert few.update is None and few.reason and few.survivors == ("d0", "d2")
    for cohort in (("d0",), ("d0", "d1")):  # below the least cohort: not run at all
        alone = secure_sum(SECURE, "t", 1, 0, {d: ups[d] for d in cohort}, None)
        assert alone.update is None and "at least 3 devices" in (alone.reason or "")


def test_every_device_clips_to_the_round_bound_and_the_sum_is_checked_against_it():
    rng = np.random.default_rng(3)
    s = PrivacySettings(secure_aggregation=True)
    ups = {f"d{i}": _upload(rng, scale=0.5) for i in range(5)}  # norms about 1.2, the bound 0.3
    out = secure_sum(s, "t", 1, 0, ups, 0.3)
    assert out.reason is None and out.update is not None
    total = np.concatenate([d.values.astype(np.float64) for d in out.update.deltas.values()])
    raw = sum(np.concatenate([d.values.astype(np.float64) for d in u.deltas.values()]) for u in ups.values())
    assert np.linalg.norm(total) <= 5 * 0.3 + 1e-4 < np.linalg.norm(raw)
    assert check_sum(np.full(9, 0.01), 2, 1.0) is None and "norm" in (check_sum(np.full(9, 1.0), 2, 1.0) or "")
    why = check_sum(np.eye(9)[3] * 2.5, 2, 10.0, 1.0) or ""
    assert "a coordinate of the unmasked sum is beyond" in why and "2.5" not in why  # no figure of the sum
    assert "clip-bit" in (check_sum(np.zeros(3), 4, 1.0, 1.0, (0.01, 0.01), 4.5) or "")
    assert check_sum(np.zeros(3), 4, 1.0, 1.0, (0.01, 0.01), 4.0) is None


def test_planned_drops_are_seeded_and_follow_the_rate():
    devs = tuple(f"d{i}" for i in range(400))
    a, b = drops_for(devs, 0.25, 5, 2), drops_for(devs, 0.25, 5, 2)
    assert a == b and 60 < len(a) < 140 and set(a.values()) <= {"after_keys", "after_shares", "after_masked",
                                                                  "after_consent"}
    assert drops_for(devs, 0.0, 5, 2) == {} and drops_for(devs, 0.25, 5, 3) != a


@pytest.fixture(scope="module")
def clients(digits):
    part = make_partition(digits.y, 10, 10, "dir0.5", seed=3, samples=400)
    return [client_data(digits, c) for c in part.clients]


@pytest.mark.parametrize("name", ["fedavg", "flayer"])
def test_a_secure_simulation_equals_the_plain_fixed_denominator_mean(digits, clients, name):
    def run(privacy: PrivacySettings):
        return simulate(make_strategy(name, digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5,
                        privacy=privacy)

    sec = run(FINE)
    ref = run(PrivacySettings(enabled=True, clip=1e6, noise_multiplier=0.0, server_lr=1.0))  # the same mean, in the clear
    assert max(float((sec.global_state[k] - ref.global_state[k]).abs().max()) for k in ref.global_state) < 1e-6
    assert [r.acc for r in sec.rounds] == [r.acc for r in ref.rounds]
    assert all(r.dropped == 0 and r.abandoned is None for r in sec.rounds)
    assert all(r.upload_bytes >= 4 * r.sent for r in sec.rounds)  # the protocol's bytes: 4 B a value and more
    narrow = run(SECURE)  # the default resolution (16 bits over R = 8): within the rounding, fewer bytes
    assert max(float((narrow.global_state[k] - ref.global_state[k]).abs().max()) for k in ref.global_state) < 1e-3
    assert all(n.upload_bytes < r.upload_bytes for n, r in zip(narrow.rounds, sec.rounds, strict=True))
    plain = simulate(make_strategy(name, digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5)
    assert not all(torch.equal(plain.global_state[k], sec.global_state[k]) for k in plain.global_state)


def test_secure_rounds_with_central_dp_add_the_noise_to_the_unmasked_sum(digits, clients):
    dp = PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.0)
    runs = [simulate(make_strategy("flayer", digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5,
                     privacy=p, seeded_noise=True) for p in (dp, PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.0,
                                                              secure_aggregation=True, secure_value_bits=28))]
    assert runs[0].epsilon == runs[1].epsilon
    assert max(float((runs[0].global_state[k] - runs[1].global_state[k]).abs().max())
               for k in runs[0].global_state) < 1e-5


def test_a_simulation_plans_dropouts_and_abandons_what_cannot_be_unmasked(digits, clients):
    strategy = make_strategy("fedavg", digits.model_spec(), TRAIN)
    res = simulate(strategy, clients, 3, seed=1, join_ratio=0.5, privacy=SECURE, secure_drop=0.4)
    assert sum(r.dropped for r in res.rounds) > 0
    assert all(np.isfinite(r.acc) for r in res.rounds)
    two = simulate(strategy, clients[:2], 1, seed=1, join_ratio=1.0, privacy=SECURE, secure_drop=0.99)
    assert two.rounds[0].abandoned is not None
    g0 = simulate(strategy, clients[:2], 0, seed=1).global_state
    assert all(torch.equal(two.global_state[k], g0[k]) for k in g0)  # an abandoned round leaves the model


def test_secure_rounds_need_data_independent_positions(digits):
    flayer = make_strategy("flayer", digits.model_spec(), TRAIN, {"positions": "topk"})
    with pytest.raises(ValueError, match="public"):
        private_strategy(flayer)


@pytest.mark.parametrize("bad, needle", [
    ({"secure_clip_range": 0.0}, "secure_clip_range"), ({"secure_clip_range": float("inf")}, "secure_clip_range"),
    ({"secure_dropout": 0.5}, "secure_dropout"), ({"secure_dropout": -0.1}, "secure_dropout"),
])
def test_bad_secure_settings_are_refused_with_the_reason(bad, needle):
    with pytest.raises(ValueError, match=needle):
        PrivacySettings(secure_aggregation=True, **bad)
    assert PrivacySettings(secure_aggregation=True).clip_range == 8.0
    assert PrivacySettings(enabled=True, clip=0.5, secure_aggregation=True).clip_range == 0.5


def test_a_masked_input_out_of_the_ring_range_abandons_the_round_instead_of_raising():
    from flayer.engine.secure import round_params
    from flayer.engine.secure_layout import layout_of
    from flayer.secagg import run_round

    rng = np.random.default_rng(4)
    ups = {f"d{i}": _upload(rng) for i in range(4)}
    params, _ = round_params(SECURE, "t", 1, tuple(sorted(ups)), layout_of(ups["d0"]), 0)
    vectors = {d: np.zeros(params.length, np.uint32) for d in ups}
    vectors["d3"] = np.full(params.length, params.ring.modulus // 2 - 1, np.uint32)  # past what 4 summands reach
    out = run_round(params, vectors, seed=b"\0" * 32)
    assert out.sum is None and "out of range" in (out.abandoned_reason or "") and out.ring_sum is not None


@pytest.mark.parametrize("name", ["fedavg", "fedper", "flayer"])
def test_the_coordinator_reads_the_round_layout_off_a_synthetic_client(digits, clients, name):
    from flayer.engine import client_round, initial_global_state
    from flayer.engine.secure_layout import round_layout
    from flayer.strategies.base import RoundContext

    strategy = private_strategy(make_strategy(name, digits.model_spec(), TRAIN))
    g = initial_global_state(strategy, 1)
    lay = round_layout(strategy, g, 3, 1)
    for i in (0, 4):
        _, res = client_round(strategy, g, strategy.initial_state(), clients[i], RoundContext(3, i, 1))
        assert res is not None and layout_of(res.update).digest == lay.digest
    assert round_layout(strategy, g, 4, 1).digest != lay.digest or name != "flayer"  # FLAYER: per round


def test_the_plan_carries_the_round_parameters_and_malformed_ones_are_refused():
    from flayer.engine.secure import plan_round, plan_secure, secure_from_plan

    ups = {f"d{i}": _upload(np.random.default_rng(5)) for i in range(3)}
    lay = layout_of(ups["d0"])
    planned = plan_round(SECURE, "fed.3.ab", 3, tuple(ups), lay, 9, None, 2.0, 12.0)
    raw = plan_secure(planned)
    back = secure_from_plan(raw, 3, tuple(ups))
    assert back == planned and back is not None and back.layout == lay.digest and back.stage_s == 12.0
    assert back.bound == 2.0 and back.value_range == 2.0
    assert secure_from_plan({}, 3, tuple(ups)) is None
    for bad in ({**raw, "threshold": 99}, {**raw, "bits": "x"}, {k: v for k, v in raw.items() if k != "length"},
                {**raw, "graph_seed": "zz"}, {**raw, "layout": "short"}, {**raw, "bound": float("nan")},
                {**raw, "value_range": 2e9}, {**raw, "run_seed": "x"}, {**raw, "value_bits": 40},
                {k: v for k, v in raw.items() if k != "dropout"}, {**raw, "dropout": 0.7}):
        with pytest.raises(ValueError, match="secure-round parameters"):
            secure_from_plan(bad, 3, tuple(ups))


def test_distributed_dp_adds_discrete_shares_in_the_ring_enough_for_any_t_survivors():
    from flayer.engine.privacy import RoundPrivacy

    rng = np.random.default_rng(6)
    ups = {f"d{i:02d}": _upload(rng, scale=0.001) for i in range(12)}
    s = PrivacySettings(enabled=True, mode="local", clip=0.1, noise_multiplier=1.0, secure_aggregation=True)
    rp = RoundPrivacy.of(s.resolve(100, 12), None)
    ring_rp = __import__("dataclasses").replace(rp, ring=True)
    assert ring_rp.share_std == 0.0 < rp.share_std  # the device adds no continuous share in a secure round
    plain = {k: sum(u.deltas[k].values.astype(np.float64) for u in ups.values()) for k in ("a.weight", "b.weight")}
    diffs = []
    for r in range(40):
        out = secure_sum(s, "t", r + 1, 3, ups, None, rp=ring_rp)
        assert out.reason is None and out.update is not None
        diffs += [out.update.deltas[k].values - plain[k] for k in plain]
    spread = float(np.concatenate(diffs).std())
    from flayer.engine.secure import round_params

    params, noise = round_params(s, "t", 1, tuple(sorted(ups)), layout_of(ups["d00"]), 3, ring_rp)
    assert noise >= rp.sum_std / math.sqrt(params.threshold)  # >= t shares carry the sum's (z C)^2
    assert spread == pytest.approx(math.sqrt(12) * noise, rel=0.1)
    assert 12 * noise**2 >= rp.sum_std**2


def test_a_simulation_with_distributed_dp_in_the_ring_reports_the_central_epsilon(digits, clients):
    def run(**kw):
        return simulate(make_strategy("flayer", digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5,
                        privacy=PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.0, **kw))

    dist, central = run(mode="local", secure_aggregation=True), run()
    assert dist.epsilon == central.epsilon and all(r.abandoned is None for r in dist.rounds)
    g, c = dist.global_state, central.global_state
    assert all(torch.isfinite(g[k]).all() for k in g) and not all(torch.equal(g[k], c[k]) for k in g)
