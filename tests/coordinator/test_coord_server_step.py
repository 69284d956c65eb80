"""The server step through the coordinator (rule 5 of coordinator.privacy): the published model is ``prev + eta * v``
on the noised average, the epsilon is the plain federation's, and the velocity goes into the checkpoint, so a
restarted coordinator resumes the same step."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_coord_privacy import _config, _Offline  # noqa: E402

from coordinator.checkpoint import load_checkpoint  # noqa: E402
from flayer.engine import Bounds, admit, check  # noqa: E402
from flayer.engine.privacy import RoundPrivacy, server_bound  # noqa: E402
from flayer.engine.round import OpenAggregate  # noqa: E402
from protocol.metrics_schema import read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def datas(digits):
    from flayer.partition import make_partition
    from flayer.train import client_data

    part = make_partition(digits.y, 10, 4, "dir0.5", seed=3, samples=240)
    return [client_data(digits, c) for c in part.clients]


def test_the_coordinator_publishes_prev_plus_eta_times_the_noised_average(tmp_path, datas):
    cfg = _config(tmp_path, rounds=1, server_lr=2.0)
    fed = _Offline(cfg, datas)
    g0 = {k: v.clone() for k, v in fed.coord.global_state.items()}
    fed.round()
    plan = fed.plans[-1]
    rp = RoundPrivacy.from_plan(plan.privacy)
    assert rp is not None
    _, ups = fed.folded[0]
    agg = OpenAggregate(fed.cache.get(plan), g0, dataclasses.replace(rp, update_multiplier=0.0))
    for u in ups:
        agg.fold(admit(u, check(u, agg.shapes), Bounds(server_bound(rp, agg.coordinates), "clip")))
    expected = agg.result()  # prev + sum / m, without noise
    # published = prev + 2 (sum + noise) / m: half the move, less the noiseless one, is the noise over m
    resid = np.concatenate([((fed.coord.global_state[k] - g0[k]) / 2 - (expected[k] - g0[k])).numpy().reshape(-1)
                            .astype(np.float64) for k in expected if g0[k].is_floating_point()]) * rp.contributions
    resid = resid[np.abs(resid) > 1e-9]
    assert resid.size > 10_000 and float(np.std(resid)) == pytest.approx(rp.sum_std, rel=0.05)
    fed.close()
    rec = [r for r in read_metrics(cfg.state_dir / "metrics.jsonl") if r["kind"] == "round"][0]
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = _Offline(_config(plain_dir, rounds=1), datas)
    plain.round()
    plain.close()
    rec_plain = [r for r in read_metrics(plain_dir / "coord" / "metrics.jsonl") if r["kind"] == "round"][0]
    assert rec["epsilon"] == rec_plain["epsilon"]  # post-processing: the same epsilon


def test_a_restarted_coordinator_resumes_the_velocity(tmp_path, datas):
    first = _Offline(_config(tmp_path, rounds=3, server_lr=1.5, server_momentum=0.5), datas)
    for _ in range(2):
        first.round()
    first.close()
    velocity = {k: v.copy() for k, v in first.coord.privacy.step.velocity.items()}
    assert velocity and any(np.abs(v).sum() > 0 for v in velocity.values())
    ckpt = load_checkpoint(tmp_path / "coord", first.coord.cycle.identity())
    assert ckpt is not None and ckpt.privacy["server_step"]["momentum"] == 0.5
    again = _Offline(_config(tmp_path, rounds=3, server_lr=1.5, server_momentum=0.5), datas)
    restored = again.coord.privacy.step.velocity
    assert set(restored) == set(velocity)
    assert all(np.allclose(restored[k], velocity[k], atol=1e-6) for k in velocity)  # saved as float32
    again.close()


def test_a_bad_server_step_stops_the_start_with_the_key(tmp_path):
    from coordinator.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="server_momentum"):
        _config(tmp_path, server_momentum=1.5)


def test_the_default_step_is_sized_by_the_noise_its_plans_name(tmp_path, datas):
    """``server_lr = "auto"`` (the default) resolves once, from z, C and the fixed denominator m the plans carry;
    a number set in the config is taken as it is."""
    from flayer.privacy_config import auto_server_lr

    fed = _Offline(_config(tmp_path, rounds=1, server_lr=None, noise_multiplier=0.05), datas)  # z C / m = 0.0075
    fed.round()
    rp = RoundPrivacy.from_plan(fed.plans[-1].privacy)
    assert rp is not None
    s = fed.coord.privacy.settings
    assert s.server_lr == auto_server_lr(s.noise_multiplier, s.clip, rp.contributions)
    assert fed.coord.privacy.step.lr == s.server_lr and s.server_lr != 1.0
    fed.close()
    other = tmp_path / "set"
    other.mkdir()
    assert _Offline(_config(other, rounds=1, server_lr=1.0), datas).coord.privacy.step.lr == 1.0
