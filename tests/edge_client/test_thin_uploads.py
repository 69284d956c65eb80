"""Error feedback and link-fitted uploads on the device (edge_client.residual, linkfit, thin)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from edge_client.config import EdgeSettings
from edge_client.linkfit import fit_upload, prepare_upload, rate_estimate, top_share, upload_budget
from edge_client.residual import ResidualStore
from edge_client.thin import ThinUploads
from flayer.config import ConfigError
from flayer.update import TensorDelta, Update
from protocol import Plan, UpdateHeader, UpdateOptions, decode_update, encode_update
from protocol.upload_cap import UploadCap, codec_ladder

SHAPES = {"conv.weight": (16, 1, 3, 3), "fc.weight": (10, 400), "fc.bias": (10,)}
HEADER = UpdateHeader("fed", 1, "dev", "ab" * 32)


def _update(rng: np.random.Generator, masked: bool = True) -> Update:
    """A FLAYER-like update: fc.weight sent at a random half of its positions, the rest dense."""
    deltas = {}
    for name, shape in SHAPES.items():
        n = int(np.prod(shape))
        idx = np.sort(rng.choice(n, n // 2, replace=False)).astype(np.int64) if masked and n > 1000 else None
        count = n if idx is None else idx.size
        deltas[name] = TensorDelta(shape, rng.normal(scale=1e-2, size=count).astype(np.float32), idx)
    return Update(deltas, 50, {})


def _dense(update: Update) -> dict[str, np.ndarray]:
    return {k: d.to_dense().reshape(-1) for k, d in update.deltas.items()}


def _size_of(update: Update, codec: str) -> int:
    return len(encode_update(update, HEADER, UpdateOptions(codec, zstd=True)))


def test_sent_plus_residual_equals_the_true_deltas_over_rounds_and_a_restart(tmp_path: Path) -> None:
    """int8 with a 30% top-k share: what the coordinator decodes, summed over the rounds, plus the
    residual on disk equals the sum of the true deltas; a new store (a rebooted device) carries on."""
    rng = np.random.default_rng(0)
    true_sum = {k: np.zeros(int(np.prod(s)), np.float64) for k, s in SHAPES.items()}
    sent_sum = {k: np.zeros(int(np.prod(s)), np.float64) for k, s in SHAPES.items()}
    cap = UploadCap("int8", 0.3)
    for r in range(1, 7):
        store = ResidualStore(tmp_path)  # a fresh instance each round: nothing kept in memory
        update = _update(rng)
        for k, v in _dense(update).items():
            true_sum[k] += v
        residual = store.before(r)
        assert bool(residual) == (r > 1)
        sent, options, fit, nxt = prepare_upload(update, codec="fp32", zstd=True, cap=cap, fit=True,
                                                 budget=_size_of(update, "int8") // 3, residual=residual,
                                                 size_of=_size_of)
        assert fit.codec == "int8" and 0.3 <= fit.keep < 1 and nxt is not None
        store.save(r, nxt)
        decoded = decode_update(encode_update(sent, HEADER, options)).update  # what the coordinator folds
        for k, v in _dense(decoded).items():
            sent_sum[k] += v
        left = ResidualStore(tmp_path).before(r + 1)
        for k in SHAPES:
            np.testing.assert_allclose(sent_sum[k] + left[k], true_sum[k], atol=2e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["residual-5.safetensors", "residual-6.safetensors"]


def test_a_retrained_round_starts_from_the_same_residual(tmp_path: Path) -> None:
    store = ResidualStore(tmp_path)
    store.save(1, {"w": np.ones(4, np.float32)})
    store.save(2, {"w": np.full(4, 2.0, np.float32)})  # crash after this, before round 2 was committed
    assert store.before(2)["w"].tolist() == [1.0] * 4  # round 2 again: the residual of round 1
    assert store.before(3)["w"].tolist() == [2.0] * 4


def test_fit_walks_the_codec_ladder_then_shrinks_the_share() -> None:
    update = _update(np.random.default_rng(1))
    cap = UploadCap("int8", 0.1)
    sizes = {c: _size_of(update, c) for c in ("fp32", "fp16", "int8")}
    assert sizes["int8"] < sizes["fp16"] < sizes["fp32"]
    assert fit_upload(update, _size_of, "fp32", cap, sizes["fp32"])[1].codec == "fp32"
    assert fit_upload(update, _size_of, "fp32", cap, sizes["fp32"] - 1)[1].codec == "fp16"
    assert fit_upload(update, _size_of, "fp32", cap, sizes["fp16"] - 1)[1].codec == "int8"
    sent, fit = fit_upload(update, _size_of, "fp32", cap, sizes["int8"] // 4)
    assert fit.codec == "int8" and fit.fits and fit.size <= sizes["int8"] // 4 and cap.min_keep <= fit.keep < 0.3
    assert fit_upload(update, _size_of, "fp32", UploadCap("fp16", 0.1), sizes["fp16"] - 1)[1].codec == "fp16"
    floor = fit_upload(update, _size_of, "fp32", UploadCap("int8", 0.5), 100)[1]
    assert floor.keep == 0.5 and not floor.fits  # never below the plan's min_keep, even if it does not fit
    unknown = fit_upload(update, _size_of, "fp32", cap, 0)[1]  # no rate known: the plan's codec, all of it
    assert (unknown.codec, unknown.keep) == ("fp32", 1.0)
    for name, d in sent.deltas.items():  # a subset of the strategy's mask, the largest values
        full = update.deltas[name]
        base = np.arange(full.numel) if full.indices is None else full.indices
        assert np.isin(d.indices if d.indices is not None else base, base).all()
        assert np.abs(d.values).min() >= np.sort(np.abs(full.values))[-d.count - 1] - 1e-12


def test_ladder_rate_and_budget() -> None:
    assert codec_ladder("fp32", "int8") == ["fp32", "fp16", "int8"]
    assert codec_ladder("int8", "fp16") == ["int8"] and codec_ladder("bf16", "int8") == ["fp16", "int8"]
    assert rate_estimate(None, 100, 1.0) is None  # too small to say anything about the rate
    assert rate_estimate(None, 100_000, 2.0) == 50_000
    assert rate_estimate(50_000, 200_000, 2.0) == 75_000
    assert upload_budget(None, 10.0) == 0 and upload_budget(125_000, 0.5) == 1
    assert upload_budget(125_000, 11.0) == 1_000_000
    d = TensorDelta((4,), np.array([0.1, -3.0, 0.2, 2.0], np.float32))
    kept = top_share(Update({"w": d}, 1, {}), 0.5).deltas["w"]
    assert kept.indices.tolist() == [1, 3] and kept.values.tolist() == [-3.0, 2.0]


def test_thin_uploads_follow_the_plan_cap_and_persist_the_rate(tmp_path: Path) -> None:
    settings = EdgeSettings(state_dir=str(tmp_path), upload="fit", error_feedback=True)
    thin = ThinUploads(settings, clock=lambda: 1000.0)
    assert thin.rate is None
    thin.measured(250_000, 2.0)
    assert ThinUploads(settings, clock=lambda: 1000.0).rate == 125_000  # survives a reboot
    update = _update(np.random.default_rng(2))
    budget = (_size_of(update, "fp32") + _size_of(update, "fp16")) // 2  # fp16 fits, fp32 does not
    plan = Plan(3, ("dev",), 1001.0 + budget / (0.8 * 125_000), "fedavg", {}, {"name": "cnn"}, "ab" * 32, 1, 10,
                upload_fit=UploadCap("int8", 0.2).as_plan(), compress=True)
    _, options = thin.prepare_for(plan, "fed", "dev")(update)
    assert options.values == "fp16" and thin.last is not None and abs(thin.last.budget - budget) <= 1
    _, options = thin.prepare_for(dataclasses.replace(plan, round=4, upload_fit=UploadCap("fp32", 0.2).as_plan()),
                                  "fed", "dev")(update)
    assert options.values == "fp32" and thin.last.keep < 1  # the plan's cap: no lower codec, a smaller share
    unknown = ThinUploads(EdgeSettings(state_dir=str(tmp_path / "u"), upload="fit"), clock=lambda: 1000.0)
    limit = _size_of(update, "int8") + 100  # no rate known yet: the plan's lowest codec, within the size limit
    _, options = unknown.prepare_for(dataclasses.replace(plan, max_update_bytes=limit), "fed", "dev")(update)
    assert options.values == "int8" and unknown.last is not None and unknown.last.budget == limit
    assert unknown.last.keep == 1.0  # nothing cut: only the codec is chosen blind
    assert (tmp_path / "residual-3.safetensors").exists()
    fixed = ThinUploads(EdgeSettings(state_dir=str(tmp_path / "f"), uplink_kbps=8.0), clock=lambda: 1000.0)
    assert fixed.rate == 1000.0
    _, options = fixed.prepare_for(plan, "fed", "dev")(update)  # upload = "plan": the plan's codec, no residual
    assert options.values == "fp32" and not (tmp_path / "f").exists()
    with pytest.raises(ConfigError, match="upload"):
        EdgeSettings(upload="auto")


def test_the_time_left_is_the_rounds_expected_close_when_the_plan_gives_one() -> None:
    from edge_client.thin import time_left

    plan = Plan(3, ("dev",), 1060.0, "fedavg", {}, {"name": "cnn"}, "ab" * 32, 1, 10)
    assert time_left(plan, 1000.0) == 60.0  # no history at the coordinator yet: the deadline
    assert time_left(dataclasses.replace(plan, close_by=1012.0), 1000.0) == 12.0  # a round closes ~12 s in
    assert time_left(dataclasses.replace(plan, close_by=1090.0), 1000.0) == 60.0  # never past the deadline
    assert time_left(dataclasses.replace(plan, close_by=1090.0, mode="async", max_staleness=8), 1000.0) == 90.0
    from flayer.engine import expected_close
    assert expected_close("async", 1000.0, 1060.0, [10.0, 30.0, 20.0], 8) == 1040.0  # two versions of the median
    assert expected_close("async", 1000.0, 1060.0, [10.0, 30.0, 20.0], 8, last=True) == 1020.0  # the last: one
    assert expected_close("async", 1000.0, 1060.0, [20.0], 0) == 1020.0  # never past max_staleness + 1
