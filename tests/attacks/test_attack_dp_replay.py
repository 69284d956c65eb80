"""Replaying the central noise from a plan (docs/explanation/privacy.md, "Where the noise comes from").

The adversary is a device, or anyone on the broker who reads the retained round plan: it holds the plan's
payload as a device receives it (decoded from the wire bytes) and the models the coordinator publishes
before and after the round. It regenerates the noise the way the coordinator would have drawn it were the
noise a function of what the plan carries (its run seed and round: :func:`flayer.engine.round.noise_seed`,
drawn in :class:`flayer.aggregate.DPSumAggregator`'s order, the adaptive clip-bit draw first), subtracts it
from ``m x (model after - model before)`` and compares the result with the round's true clipped sum (which
the test knows and the adversary does not). The guarantee holds when the recovered sum is still off by
about the noise itself: the remaining error's norm must be at least half of ``z C sqrt(d)``, the norm of the
noise on the ``d`` coordinates the uploads carried.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from attacklib import brokerless_coordinator

from coordinator.config import load_coordinator_config
from edge_client.work import StrategyCache, round_context, train_and_encode
from flayer.engine.privacy import RoundPrivacy, clip_upload
from flayer.engine.round import noise_seed
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import SigningKey, Status, Topics, WireLimits, decode_message, decode_update, encode_message
from transport.credentials import Credentials
from transport.link import Received

DEVICES = ["dev-0", "dev-1", "dev-2", "dev-3"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS = {d: SigningKey.generate() for d in DEVICES}  # the devices' keys, as the broker's registry holds them


def _config(tmp: Path, clipping: str, mode: str = "sync") -> Any:
    asynchronous = ['mode = "async"', "buffer = 2", "concurrency = 0"] if mode == "async" else []
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 4", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 60.0", "grace_s = 0.0", *asynchronous,
             "[run]", 'strategy = "flayer"', "rounds = 2", "seed = 3", "[data]", 'dataset = "digits"',
             "[privacy]", "enabled = true", "population = 4", "clip = 0.3", "noise_multiplier = 1.0",
             "delta = 0.01", f'clipping = "{clipping}"', "count_stddev = 2.0"]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    return load_coordinator_config(tmp / "federation.toml")


@pytest.fixture(scope="module")
def datas(digits):
    part = make_partition(digits.y, 10, 4, "dir0.5", seed=3, samples=240)
    return [client_data(digits, c) for c in part.clients]


def _run_round(tmp: Path, datas: list[Any], clipping: str, mode: str = "sync"
               ) -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """One private round (asynchronous: one model version, its buffer of 2) through the coordinator's loop (no
    broker): (the plan's wire payload, the model published before, the model published after, the true sum of
    the clipped uploads per tensor)."""
    now = [1000.0]
    c, plans = brokerless_coordinator(_config(tmp, clipping, mode), CREDS, lambda: now[0], KEYS)
    for d in DEVICES:
        c.registry.observe(d, Status(0, "online", now[0]), now[0])
    try:
        c._tick()
        assert c.open is not None
        plan = plans[-1]
        payload = encode_message(plan, "utest", "coordinator")  # what the broker retains and devices receive
        before = {k: v.clone() for k, v in c.global_state.items()}
        rp = RoundPrivacy.from_plan(plan.privacy)
        assert rp is not None
        cache = StrategyCache({"lr": 0.05, "batch_size": 10, "local_epochs": 1, "device": "cpu"})
        strategy = cache.get(plan)
        truth: dict[str, np.ndarray] = {}
        for dev in sorted(plan.selected)[:2 if mode == "async" else None]:  # async: the version's buffer
            i = DEVICES.index(dev)
            up = train_and_encode(strategy, plan, before, strategy.initial_state(), datas[i],
                                  round_context(plan, i, torch.device("cpu")), federation="utest", sender=dev,
                                  max_payload=1 << 20, max_update_bytes=0, amp=False, key=KEYS[dev])
            upd = decode_update(up.blob, WireLimits(), dict(c.open.aggregate.shapes)).update
            clipped, _ = clip_upload(upd, rp.clip)  # what the coordinator folds (it re-clips)
            for name, d in clipped.deltas.items():
                acc = truth.setdefault(name, np.zeros(int(np.prod(d.shape)), dtype=np.float64))
                if d.indices is None:
                    acc += d.values.astype(np.float64)
                else:
                    acc[d.indices] += d.values.astype(np.float64)
            for k, chunk in enumerate(up.payloads):
                c.intake.on_message(Received(Topics("utest").update_chunk(dev, plan.round, k), chunk, False))
        now[0] += 1.0
        c._tick()  # every selected device uploaded, no grace: the round closes and the next model is published
        after = {k: v.clone() for k, v in c.global_state.items()}
        return payload, before, after, truth
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()


def _replay(payload: bytes, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The adversary: the clipped sum it recovers from the plan and the two published models."""
    _, plan = decode_message(payload)
    rp = RoundPrivacy.from_plan(plan.privacy)
    assert rp is not None
    rng = np.random.default_rng(noise_seed(plan.seed, plan.round))
    if rp.adaptive:
        rng.normal(0.0, rp.bit_std)  # the clip-bit count's draw comes first
    out = {}
    for name, prev in before.items():
        diff = after[name].numpy().reshape(-1).astype(np.float64) - prev.numpy().reshape(-1).astype(np.float64)
        pos = np.flatnonzero(diff != 0)  # the coordinates the uploads carried (noise makes every one move)
        rec = np.zeros(diff.size)
        rec[pos] = diff[pos] * rp.contributions - rng.normal(0.0, rp.sum_std, pos.size)
        out[name] = rec
    return out


@pytest.mark.parametrize(("clipping", "mode"), [("fixed", "sync"), ("adaptive", "sync"), ("fixed", "async")])
def test_a_plan_reader_cannot_subtract_the_central_noise(tmp_path, datas, clipping, mode):
    payload, before, after, truth = _run_round(tmp_path, datas, clipping, mode)
    recovered = _replay(payload, before, after)
    rp = RoundPrivacy.from_plan(decode_message(payload)[1].privacy)
    assert rp is not None and rp.sum_std > 0
    carried = sum(int(np.count_nonzero(after[n].numpy() != before[n].numpy())) for n in before)
    assert carried > 0, "no model was published after the round (or version)"
    err = np.sqrt(sum(float(np.sum((recovered[n] - truth.get(n, 0.0)) ** 2)) for n in before))
    noise_norm = rp.sum_std * np.sqrt(carried)
    # the published models' float32 rounding alone leaves about 1e-7 of each value: a replayed noise brings
    # the error down to that; fresh noise leaves about z C sqrt(d)
    assert err >= 0.5 * noise_norm, (f"the plan reader recovered the round's clipped sum to {err:.3g} "
                                     f"(the noise's norm is {noise_norm:.3g}): the noise is replayable")
