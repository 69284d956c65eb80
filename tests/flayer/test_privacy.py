"""Client-level DP in the round engine (docs/explanation/privacy.md): the settings and their refusals, the
clip and the noise scale against their formulas, the fixed denominator, public positions, adaptive clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flayer.aggregate import DPSumAggregator
from flayer.config import ConfigError, TrainConfig, from_mapping, load_run_config
from flayer.engine import select_clients
from flayer.engine.privacy import (
    UNCLIPPED_KEY,
    RoundPrivacy,
    adaptive_update_multiplier,
    clip_upload,
    combined_multiplier,
    next_clip,
    private_strategy,
    privatize,
    server_bound,
    upload_norm,
)
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings, default_delta
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.train import client_data
from flayer.update import TensorDelta, Update

TRAIN = TrainConfig(lr=0.05, batch_size=10, device="cpu")


def _update(values: dict[str, np.ndarray], idx: dict[str, np.ndarray] | None = None, n: int = 5,
            info: dict[str, float] | None = None, numel: int = 100) -> Update:
    idx = idx or {}
    return Update({k: TensorDelta((v.size if k not in idx else numel,), v.astype(np.float32), idx.get(k))
                   for k, v in values.items()}, n, info or {})


# ---- settings ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, needle", [
    ({"clip": 0.0}, "clip (C) must be"), ({"clip": -1.0}, "clip (C) must be"),
    ({"noise_multiplier": 0.0, "target_epsilon": 4.0}, "target_epsilon needs noise"),
    ({"noise_multiplier": -0.5}, "noise_multiplier (z)"), ({"mode": "secret"}, "mode"),
    ({"clipping": "adaptive", "mode": "local", "enabled": True}, "needs mode = \"central\""),
    ({"target_quantile": 1.0}, "target_quantile"), ({"delta": 1.5}, "delta must be in (0, 1)"),
    ({"unknown_knob": 1}, "unknown key"),
])
def test_bad_settings_are_refused_with_the_reason(bad, needle):
    with pytest.raises(ConfigError, match="privacy") as exc:
        from_mapping(PrivacySettings, bad, "[privacy]")
    assert needle in str(exc.value)


def test_delta_must_be_below_one_over_n_and_the_default_means_something_at_any_n():
    s = PrivacySettings(enabled=True).resolve(100, 10)
    assert s.delta == 1e-5 == default_delta(100)
    assert s.expected_contributions == 10 and s.population == 100
    # a four-device federation: the old default 1/N^1.1 was 0.218; now 1e-5, and N delta <= 0.1 at any N
    assert default_delta(4) == 1e-5 and default_delta(10**6) == pytest.approx(1e-7)
    assert all(n * default_delta(n) <= 0.1 for n in (2, 4, 100, 10**4, 10**5, 10**7))
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1/N\)"):
        PrivacySettings(enabled=True, delta=0.01).resolve(100, 10)  # 1/N itself
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1/N\)"):
        PrivacySettings(enabled=True, delta=0.3).resolve(4, 2)  # above 1/N
    with pytest.raises(ValueError, match="smaller than"):
        PrivacySettings(enabled=True, population=50).resolve(100, 10)
    with pytest.raises(ValueError, match="below count_stddev"):  # z must stay below sigma_b (sensitivity 1)
        PrivacySettings(enabled=True, clipping="adaptive", noise_multiplier=1.0, count_stddev=1.0).resolve(100, 10)
    # unset, sigma_b is max(m / 20, 2 z): 2 z here, so any z is accepted and the update noise is z / sqrt(3/4)
    s = PrivacySettings(enabled=True, clipping="adaptive", noise_multiplier=1.0).resolve(100, 10)
    assert s.bit_stddev == 2.0 and RoundPrivacy.of(s).update_multiplier == pytest.approx(0.75 ** -0.5)
    assert PrivacySettings(enabled=True, clipping="adaptive", noise_multiplier=1.0).resolve(1000, 100).bit_stddev == 5.0


def test_run_config_reads_the_privacy_table(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[run]\nstrategy = "fedavg"\n[privacy]\nenabled = true\nclip = 0.5\nnoise_multiplier = 1.2\n'
                 'target_epsilon = 8.0\n')
    cfg = load_run_config(f)
    assert cfg.privacy == PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.2, target_epsilon=8.0)
    assert load_run_config(f, {"privacy": {"clip": 2.0}}).privacy.clip == 2.0  # flags win
    f.write_text('[privacy]\nclip = 0\n')
    with pytest.raises(ConfigError, match=r"\[privacy\].*clip"):
        load_run_config(f)


def test_strategy_options_dp_cannot_honour_are_refused(digits):
    spec = digits.model_spec()
    with pytest.raises(ValueError, match="positions = \"topk\""):
        private_strategy(make_strategy("flayer", spec, TRAIN, {"positions": "topk"}))
    with pytest.raises(ValueError, match="server_rule 'median'"):
        private_strategy(make_strategy("flayer", spec, TRAIN, {"server_rule": "median"}))
    with pytest.raises(ValueError, match="calibration round"):
        private_strategy(make_strategy("flayer", spec, TRAIN, {"head_layers": "auto"}))
    assert private_strategy(make_strategy("flayer", spec, TRAIN)).options.positions == "public"
    assert private_strategy(make_strategy("fedavg", spec, TRAIN)).name == "fedavg"


# ---- clip and noise against their formulas ----------------------------------------------------------------------
def test_clip_scales_to_c_and_leaves_small_updates_alone():
    up = _update({"a": np.array([3.0, 0.0]), "b": np.array([4.0])})  # norm 5
    clipped, norm = clip_upload(up, 1.0)
    assert norm == pytest.approx(5.0) and 1.0 - 1e-5 < upload_norm(clipped) <= 1.0
    np.testing.assert_allclose(clipped.deltas["a"].values, [0.6, 0.0], rtol=1e-6)  # Delta * C / ||Delta||
    same, _ = clip_upload(up, 10.0)
    assert same is up


def test_noise_std_formulas_central_and_local_share():
    s = PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.5).resolve(1000, 16)
    central = RoundPrivacy.of(s)
    assert central.sum_std == pytest.approx(1.5 * 0.5) and central.share_std == 0.0
    local = RoundPrivacy.of(PrivacySettings(enabled=True, mode="local", clip=0.5, noise_multiplier=1.5)
                            .resolve(1000, 16))
    assert local.share_std == pytest.approx(1.5 * 0.5 / 4)  # z C / sqrt(m), m = 16
    assert 16 * local.share_std ** 2 == pytest.approx((1.5 * 0.5) ** 2)  # the m shares sum to (z C)^2
    # measured: the empirical std of a device's share, and of the coordinator's noise on the sum
    up = _update({"w": np.zeros(200_000)})
    noised = privatize(up, local, np.random.default_rng(1))
    assert np.std(noised.deltas["w"].values) == pytest.approx(local.share_std, rel=0.01)
    agg = DPSumAggregator({"w": torch.zeros(200_000)}, 16, central.sum_std, seed=3)
    agg.fold(up)
    assert np.std(agg.result()["w"].numpy() * 16) == pytest.approx(central.sum_std, rel=0.01)


def test_privatize_takes_no_generator_in_central_mode_and_refuses_none_where_it_adds_noise():
    """No seeded fallback: a device that must add noise and has no generator of its own raises."""
    central = RoundPrivacy.of(PrivacySettings(enabled=True, clip=1.0, noise_multiplier=1.0).resolve(100, 16))
    out = privatize(_update({"w": np.array([3.0, 4.0])}), central, None)
    np.testing.assert_allclose(out.deltas["w"].values, [0.6, 0.8], rtol=1e-5)  # clipped (just inside C), not noised
    local = RoundPrivacy.of(PrivacySettings(enabled=True, mode="local", clip=1.0, noise_multiplier=1.0)
                            .resolve(100, 16))
    with pytest.raises(ValueError, match="noise generator"):
        privatize(_update({"w": np.array([3.0, 4.0])}), local, None)


def test_privatize_reports_the_clip_bit_and_drops_strategy_info():
    s = PrivacySettings(enabled=True, clipping="adaptive", clip=1.0, noise_multiplier=0.5).resolve(100, 20)
    rp = RoundPrivacy.of(s)
    big = privatize(_update({"w": np.array([3.0, 4.0])}, info={"acc_val": 0.9, "train_loss": 1.0}), rp,
                    np.random.default_rng(0))
    small = privatize(_update({"w": np.array([0.3, 0.4])}), rp, np.random.default_rng(0))
    assert big.info == {UNCLIPPED_KEY: 0.0, "train_loss": 1.0} and small.info[UNCLIPPED_KEY] == 1.0
    assert 1.0 - 1e-5 < upload_norm(big) <= 1.0  # never above C (the coordinator counts what it clips)


def test_server_bound_is_c_central_and_covers_the_share_local():
    s = PrivacySettings(enabled=True, clip=2.0, noise_multiplier=1.0)
    assert server_bound(RoundPrivacy.of(s.resolve(100, 4)), 10_000) == 2.0
    loc = RoundPrivacy.of(PrivacySettings(enabled=True, mode="local", clip=2.0, noise_multiplier=1.0).resolve(100, 4))
    honest = privatize(_update({"w": np.full(10_000, 1.0)}), loc, np.random.default_rng(0))
    assert upload_norm(honest) < server_bound(loc, 10_000)


def test_adaptive_clipping_follows_andrew_et_al():
    # z_Delta = (z^-2 - sigma_b^-2)^-1/2: the clip bits' sensitivity is 1 under zero-out neighbours
    assert adaptive_update_multiplier(1.0, 2.0) == pytest.approx((1 - 0.25) ** -0.5)
    with pytest.raises(ValueError, match="below count_stddev"):
        adaptive_update_multiplier(1.0, 1.0)
    # C <- C exp(-eta (b/m - gamma)): every update unclipped -> C shrinks by exp(-0.2 * 0.5)
    assert next_clip(1.0, 10.0, 10, 0.5, 0.2) == pytest.approx(math.exp(-0.1))
    assert next_clip(1.0, 0.0, 10, 0.5, 0.2) == pytest.approx(math.exp(0.1))


def test_adaptive_clipping_spends_what_one_gaussian_at_z_spends():
    """Andrew et al. Thm 1, against dp-accounting: the update noise at z_Delta (sensitivity C) and the clip-bit
    count noised at sigma_b (sensitivity 1, so multiplier sigma_b) are together the Gaussian mechanism at z:
    z^-2 = z_Delta^-2 + sigma_b^-2; and what the plan names gives z back (the multiplier every ledger books)."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import rdp_privacy_accountant

    for z, sigma_b in ((0.607, 1.0), (0.9, 1.0), (1.3, 5.0), (1.8985, 3.797)):
        zd = adaptive_update_multiplier(z, sigma_b)
        assert zd ** -2 + sigma_b ** -2 == pytest.approx(z ** -2)
        assert combined_multiplier(zd, sigma_b) == pytest.approx(z, rel=1e-12)
        rp = RoundPrivacy("central", 1.0, z, zd, 20, adaptive=True, bit_std=sigma_b)
        assert rp.named_multiplier == pytest.approx(z, rel=1e-12) and rp.noise_problem() is None
        both = dpa.SelfComposedDpEvent(dpa.ComposedDpEvent([dpa.GaussianDpEvent(zd), dpa.GaussianDpEvent(sigma_b)]),
                                       10)
        one = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 10)
        eps = [rdp_privacy_accountant.RdpAccountant().compose(e).get_epsilon(1e-5) for e in (both, one)]
        assert eps[0] == pytest.approx(eps[1], rel=1e-9)


def test_a_plan_is_counted_by_the_noise_it_names_not_its_label():
    """A plan labelled z = 1000 whose update noise is 0 names no noise; one whose bit noise is 1e-9 under adaptive
    clipping names almost none: named_multiplier says so, and noise_problem refuses both."""
    zero = RoundPrivacy("central", 1.0, 1000.0, 0.0, 20)
    assert zero.named_multiplier == 0.0 and "no noise" in (zero.noise_problem() or "")
    tiny_bits = RoundPrivacy("central", 1.0, 1.0, 1.0, 20, adaptive=True, bit_std=1e-9)
    assert tiny_bits.named_multiplier < 1e-8 and "is not what" in (tiny_bits.noise_problem() or "")
    no_bits = RoundPrivacy("central", 1.0, 1.0, 1.0, 20, adaptive=True, bit_std=0.0)
    assert "un-noised" in (no_bits.noise_problem() or "")
    label = RoundPrivacy("central", 1.0, 1000.0, 1.0, 20)
    assert "label" in (label.noise_problem() or "")
    assert RoundPrivacy("central", 1.0, 1.0, 1.0, 20).noise_problem() is None


def test_the_clip_bit_count_moves_by_one_for_a_zero_out_neighbour():
    """The released bit statistic is the centred sum. A device whose update was clipped reports 0; in the zero-out
    neighbouring world the same device uploads zeros, whose norm is within C: bit 1. The count moves by 1 between
    the two (the same seeded draw on both sides) -- the sensitivity the accountant uses -- not the 1/2 of adding
    or removing a device."""
    g = {"w": torch.zeros(4)}
    rp = RoundPrivacy("central", 0.5, 1.0, adaptive_update_multiplier(1.0, 2.0), 8, adaptive=True, bit_std=2.0)

    def noised(bits: list[int]) -> float:
        agg = DPSumAggregator(g, contributions=8, noise_std=0.0, seed=5, bit_std=2.0)
        for b in bits:
            agg.fold(_update({"w": np.array([0.1, 0.1])}, {"w": np.array([0, 1])}, info={UNCLIPPED_KEY: float(b)},
                             numel=4))
        return agg.noised_bits()

    clipped = privatize(_update({"w": np.array([30.0, 40.0])}, {"w": np.array([0, 1])}, numel=4), rp, None)
    zero = privatize(_update({"w": np.array([0.0, 0.0])}, {"w": np.array([0, 1])}, numel=4), rp, None)
    assert (clipped.info[UNCLIPPED_KEY], zero.info[UNCLIPPED_KEY]) == (0.0, 1.0)
    assert noised([1, 0, 1, 1]) - noised([1, 0, 1, 0]) == pytest.approx(1.0)
    # on the count's scale: with no noise the estimate is the count of unclipped uploads, m / 2 shifted
    agg = DPSumAggregator(g, contributions=4, noise_std=0.0, seed=5, bit_std=1e-12)
    for b in (1, 1, 1, 0):
        agg.fold(_update({"w": np.array([0.1])}, {"w": np.array([0])}, info={UNCLIPPED_KEY: float(b)}, numel=4))
    assert agg.noised_bits() == pytest.approx(3.0)
    assert next_clip(1.0, 40.0, 10, 0.5, 0.2) == pytest.approx(math.exp(-0.1))  # b_bar kept in [0, 1]


# ---- the fixed denominator --------------------------------------------------------------------------------------
def test_fixed_denominator_divides_by_m_not_by_who_sent():
    g = {"w": torch.ones(4)}
    agg = DPSumAggregator(g, contributions=10, noise_std=0.0, seed=0)
    agg.fold(_update({"w": np.array([1.0, 2.0])}, {"w": np.array([0, 1])}, n=1000, numel=4), weight=1000)
    out = agg.result()["w"].numpy()
    # carry would give 1 + 1.0 (one sender, its own weight): here the device's delta is divided by m = 10
    np.testing.assert_allclose(out, [1.1, 1.2, 1.0, 1.0], rtol=1e-6)
    assert agg.unsent() == 2


def test_central_noise_comes_from_the_seed_and_lands_only_where_uploads_went():
    g = {"w": torch.zeros(6), "personal": torch.zeros(3)}
    outs = []
    for _ in range(2):
        agg = DPSumAggregator(g, contributions=2, noise_std=1.0, seed=42)
        agg.fold(_update({"w": np.array([0.5, 0.5])}, {"w": np.array([1, 4])}, numel=6))
        outs.append(agg.result())
    assert torch.equal(outs[0]["w"], outs[1]["w"])
    w = outs[0]["w"].numpy()
    assert (w[[0, 2, 3, 5]] == 0).all() and (w[[1, 4]] != 0.25).all()
    assert torch.equal(outs[0]["personal"], torch.zeros(3))  # a tensor nobody uploads gets no noise
    other = DPSumAggregator(g, contributions=2, noise_std=1.0, seed=43)
    other.fold(_update({"w": np.array([0.5, 0.5])}, {"w": np.array([1, 4])}, numel=6))
    assert not torch.equal(other.result()["w"], outs[0]["w"])


# ---- positions that do not leak ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["flayer", "flayer-ref"])
def test_public_positions_do_not_depend_on_the_data(digits, name):
    part = make_partition(digits.y, 10, 4, "dir0.5", seed=3, samples=400)
    datas = [client_data(digits, c) for c in part.clients]
    strategy = private_strategy(make_strategy(name, digits.model_spec(), TRAIN))
    g = {k: v.clone() for k, v in strategy.new_model().state_dict().items() if v.is_floating_point()}

    def positions(data, client: int, round_: int = 1):
        ctx = RoundContext(round=round_, client=client, seed=7)
        model = strategy.receive(g, strategy.initial_state(), data, ctx)
        up = strategy.local_round(model, g, strategy.initial_state(), data, ctx).update
        return {k: None if d.indices is None else d.indices.tolist() for k, d in up.deltas.items()}

    a, b = positions(datas[0], 0), positions(datas[1], 1)  # other data, other device, same round
    assert a == b and any(v is not None for v in a.values())
    assert positions(datas[2], 0, round_=2) != a  # a new round draws new positions
    topk = make_strategy(name, digits.model_spec(), TRAIN)  # the default top-k follows the data
    ctx = RoundContext(round=1, client=0, seed=7)
    ups = [topk.local_round(topk.receive(g, topk.initial_state(), d, ctx), g, topk.initial_state(), d, ctx).update
           for d in datas[:2]]
    idx = [{k: None if d.indices is None else d.indices.tolist() for k, d in u.deltas.items()} for u in ups]
    assert any(v is not None and v != idx[1][k] for k, v in idx[0].items())


# ---- the simulator runs it --------------------------------------------------------------------------------------
def test_a_private_simulation_clips_noises_and_reports_epsilon(digits):
    part = make_partition(digits.y, 10, 10, "dir0.5", seed=3, samples=400)
    clients = [client_data(digits, c) for c in part.clients]
    dp = PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.0)
    runs = [simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5,
                     privacy=dp, seeded_noise=seeded) for seeded in (True, True, False)]
    # --dp-seeded-noise reproduces a run; the default noise comes from the CSPRNG and differs from it
    assert all(torch.equal(runs[0].global_state[k], runs[1].global_state[k]) for k in runs[0].global_state)
    assert not any(torch.equal(runs[0].global_state[k], runs[2].global_state[k]) for k in runs[0].global_state)
    eps = [r.epsilon for r in runs[0].rounds]
    assert eps[0] is not None and eps[1] is not None and 0 < eps[0] < eps[1] == runs[0].epsilon
    assert runs[0].delta == 1e-5
    plain = simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5)
    assert plain.epsilon is None and plain.rounds[0].epsilon is None
    assert not all(torch.equal(plain.global_state[k], runs[0].global_state[k]) for k in plain.global_state)
    assert len(select_clients(10, 0.5, 1, 1)) == 5


def test_local_mode_noises_on_the_devices_and_reports_the_same_epsilon(digits):
    part = make_partition(digits.y, 10, 10, "dir0.5", seed=3, samples=400)
    clients = [client_data(digits, c) for c in part.clients]
    runs = {mode: simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 2, seed=1, join_ratio=0.5,
                           privacy=PrivacySettings(enabled=True, mode=mode, clip=0.5, noise_multiplier=1.0))
            for mode in ("central", "local")}
    assert runs["local"].epsilon == runs["central"].epsilon  # the sum carries the same noise (z C)^2
    g_c, g_l = runs["central"].global_state, runs["local"].global_state
    assert all(torch.isfinite(g_l[k]).all() for k in g_l) and not all(torch.equal(g_c[k], g_l[k]) for k in g_c)


def test_plan_time_warnings_for_a_population_or_an_epsilon_too_weak():
    small = PrivacySettings(enabled=True, noise_multiplier=1.0).resolve(4, 2)
    assert any("population N = 4" in w for w in small.warnings(3.0, 10))
    assert any("epsilon 14.1 after 10 rounds" in w for w in small.warnings(14.1, 10))
    large = PrivacySettings(enabled=True, noise_multiplier=3.0).resolve(1000, 50)
    assert large.warnings(4.0, 10) == []


def test_plans_that_name_no_countable_noise_or_odd_fields_are_refused():
    """What a coordinator may write into a plan's privacy mapping: a multiplier so small that its square underflows
    (epsilon_for used to raise ZeroDivisionError and stop the device), a subnormal C (the float32 upload rounds past
    it), and flags as strings (bool("false") is True)."""
    from flayer.engine.accountant import epsilon_for

    assert epsilon_for([(1e-300, 1.0, 1)], 1e-5) == math.inf
    assert "below 0.01" in (RoundPrivacy("central", 1.0, 1e-300, 1e-300, 3).noise_problem() or "")
    base = RoundPrivacy("central", 1.0, 1.0, 1.0, 3).as_plan()
    with pytest.raises(ValueError, match="out of range"):
        RoundPrivacy.from_plan({**base, "clip": 7e-44})
    for flag in ("adaptive", "ring"):
        with pytest.raises(ValueError, match=f"{flag} must be true or false"):
            RoundPrivacy.from_plan({**base, flag: "false"})
    assert RoundPrivacy.from_plan(base) == RoundPrivacy("central", 1.0, 1.0, 1.0, 3)


def test_privacy_noise_comes_from_the_chacha20_keystream(monkeypatch):
    """The published noise is drawn from a CSPRNG (ChaCha20 keyed by the operating system), never from numpy's
    PCG64, whose outputs would predict one another: a numpy generator made without a seed fails the draw."""
    import flayer.aggregate as aggregate
    from flayer.secagg.prg import KeystreamRandom

    real = np.random.default_rng

    def seeded_only(seed=None):
        assert seed is not None, "privacy noise drawn from numpy's generator"
        return real(seed)

    monkeypatch.setattr(aggregate.np.random, "default_rng", seeded_only)
    agg = DPSumAggregator({"w": torch.zeros(4)}, contributions=2, noise_std=1.0, bit_std=1.0)
    agg.fold(_update({"w": np.ones(4)}, info={UNCLIPPED_KEY: 1.0}))
    assert torch.isfinite(agg.result()["w"]).all() and math.isfinite(agg.noised_bits())
    z = KeystreamRandom().normal(0.0, 2.0, 200_000)
    assert abs(float(z.mean())) < 0.03 and abs(float(z.std()) - 2.0) < 0.03
    assert isinstance(KeystreamRandom().normal(0.0, 1.0), float)
