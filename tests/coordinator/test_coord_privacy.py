"""A private federation through the coordinator's own loop without a broker (publications recorded, a fake
clock, update chunks delivered as the broker would): the plan carries C, z and m, the devices' real edge code
clips what leaves them, the coordinator re-clips and folds a noised sum that equals the engine's (the
simulator's) for the same seed, the round records and the end record show epsilon, a target epsilon ends the
federation at the round the accountant predicts, and a restarted coordinator neither forgets nor double-counts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.checkpoint import load_checkpoint
from coordinator.config import load_coordinator_config
from coordinator.result import CoordinatorError
from coordinator.server import Coordinator
from edge_client.work import StrategyCache, round_context, train_and_encode
from flayer.engine import Bounds, admit, check
from flayer.engine.accountant import epsilon_for, rounds_for_target
from flayer.engine.privacy import RoundPrivacy, server_bound
from flayer.engine.round import OpenAggregate
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import Status, Topics, WireLimits, decode_update
from protocol.metrics_schema import read_metrics
from transport.credentials import Credentials
from transport.link import Received

DEVICES = ["dev-0", "dev-1", "dev-2", "dev-3"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20)
PRIVACY = {"enabled": True, "population": 4, "clip": 0.3, "noise_multiplier": 1.0, "delta": 0.05}


def _config(tmp: Path, rounds: int = 3, **privacy: Any) -> Any:
    table = {k: v for k, v in {**PRIVACY, **privacy}.items() if v is not None}  # None: the key left out
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 4", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 60.0", "grace_s = 0.0",
             "[run]", 'strategy = "flayer"', f"rounds = {rounds}", "seed = 3", "[data]", 'dataset = "digits"',
             "[privacy]", *(f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in table.items())]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    return load_coordinator_config(tmp / "federation.toml")


@pytest.fixture(scope="module")
def datas(digits):
    part = make_partition(digits.y, 10, 4, "dir0.5", seed=3, samples=240)
    return [client_data(digits, c) for c in part.clients]


class _Offline:
    """The coordinator without a broker; devices run the real edge code (edge_client.work)."""

    def __init__(self, cfg: Any, datas: list[Any]) -> None:
        self.now, self.datas = 1000.0, datas
        self.plans: list[Any] = []
        self.coord = c = Coordinator(cfg, CREDS, clock=lambda: self.now)
        setattr(c, "_publish_model", lambda round_: setattr(c, "_chunks", 1))  # noqa: B010 -- no broker
        setattr(c, "_publish_plan", lambda phase="train": self._record(c._plan(phase)))  # noqa: B010
        setattr(c.publisher, "clear_old_models", lambda: 0)  # noqa: B010
        setattr(c.publisher, "plan", self._record)  # noqa: B010
        setattr(c.inbox, "ack", lambda *a, **k: None)  # noqa: B010
        c.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        c._restore()
        for d in DEVICES:
            c.registry.observe(d, Status(0, "online", self.now), self.now)
        self.cache = StrategyCache({"lr": 0.05, "batch_size": 10, "local_epochs": 1, "device": "cpu"})
        self.states: dict[str, Any] = {d: None for d in DEVICES}
        self.folded: list[tuple[int, list[Any]]] = []

    def _record(self, plan: Any) -> int:
        self.plans.append(plan)
        return 0

    def round(self) -> None:
        """Open a round, let every selected device train and upload, close it."""
        c = self.coord
        c._tick()
        if c.open is None:
            return
        plan = self.plans[-1]
        strategy = self.cache.get(plan)
        g = {k: v.clone() for k, v in c.global_state.items()}
        decoded = []
        for dev in sorted(plan.selected):
            i = DEVICES.index(dev)
            state = self.states[dev] or strategy.initial_state()
            up = train_and_encode(strategy, plan, g, state, self.datas[i], round_context(plan, i, torch.device("cpu")),
                                  federation="utest", sender=dev, max_payload=1 << 20, max_update_bytes=0, amp=False)
            self.states[dev] = up.state
            decoded.append(decode_update(up.blob, WireLimits(), dict(c.open.aggregate.shapes)).update)
            for k, payload in enumerate(up.payloads):
                c._on_message(Received(Topics("utest").update_chunk(dev, plan.round, k), payload, False))
        self.folded.append((plan.round, decoded))
        self.now += 1.0
        c._tick()  # quorum (every selected device) and no grace: the round closes

    def close(self) -> None:
        setattr(self.coord, "_shut_down", lambda: None)  # noqa: B010
        self.coord.metrics.close()


def test_private_rounds_through_the_coordinator_equal_the_engine(tmp_path, datas):
    cfg = _config(tmp_path)
    fed = _Offline(cfg, datas)
    g0 = {k: v.clone() for k, v in fed.coord.global_state.items()}
    fed.round()
    plan = fed.plans[-1]
    rp = RoundPrivacy.from_plan(plan.privacy)
    assert rp is not None and rp.clip == 0.3 and rp.contributions == 2 and plan.options["positions"] == "public"
    _, ups = fed.folded[0]
    assert all(np.sqrt(sum(float(np.sum(d.values.astype(np.float64) ** 2)) for d in u.deltas.values())) <= 0.3 + 1e-5
               for u in ups)  # clipped on the device
    assert all(set(u.info) <= {"test_correct", "test_total", "train_loss"} for u in ups)  # no acc_val leaves
    # the engine (what flayer simulate runs) folds the same uploads without noise: the coordinator's model
    # differs from it by fresh noise of std z C on each summed coordinate, over m
    strategy = fed.cache.get(plan)
    agg = OpenAggregate(strategy, g0, dataclasses.replace(rp, update_multiplier=0.0))
    for u in ups:
        agg.fold(admit(u, check(u, agg.shapes), Bounds(server_bound(rp, agg.coordinates), "clip")))
    expected = agg.result()
    resid = np.concatenate([(fed.coord.global_state[k] - expected[k]).numpy().reshape(-1).astype(np.float64)
                            for k in expected]) * rp.contributions
    resid = resid[resid != 0]
    assert resid.size > 10_000 and float(np.std(resid)) == pytest.approx(rp.sum_std, rel=0.05)
    for _ in range(2):
        fed.round()
    fed.close()
    rounds = [rec for rec in read_metrics(cfg.state_dir / "metrics.jsonl") if rec["kind"] == "round"]
    assert [rec["round"] for rec in rounds] == [1, 2, 3]
    assert [rec["epsilon"] for rec in rounds] == pytest.approx([epsilon_for([(1.0, 0.5, t)], 0.05) for t in (1, 2, 3)])
    assert rounds[0]["dp_sample_rate"] == 0.5 and rounds[0]["dp_clip"] == 0.3


def test_a_restarted_coordinator_reports_the_same_epsilon(tmp_path, datas):
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole_dir.mkdir(), split_dir.mkdir()
    whole = _Offline(_config(whole_dir, rounds=3), datas)
    for _ in range(3):
        whole.round()
    whole.close()
    first = _Offline(_config(split_dir, rounds=3), datas)
    for _ in range(2):
        first.round()
    first.close()  # stopped after round 2
    ckpt = load_checkpoint(split_dir / "coord", first.coord.identity())
    assert ckpt is not None and ckpt.privacy["ledger"] == [[1.0, 0.5, 2]]
    again = _Offline(_config(split_dir, rounds=3), datas)
    assert again.coord.privacy.ledger.rounds == 2  # not forgotten
    again.states = first.states
    again.round()
    again.close()
    assert again.coord.privacy.ledger.rounds == 3  # and not composed twice
    assert again.coord.privacy.epsilon() == whole.coord.privacy.epsilon()
    last = [rec for rec in read_metrics(split_dir / "coord" / "metrics.jsonl") if rec["kind"] == "round"][-1]
    assert last["round"] == 3 and last["epsilon"] == pytest.approx(whole.coord.privacy.epsilon())


def test_target_epsilon_ends_the_federation_before_the_budget(tmp_path, datas):
    expected = rounds_for_target(2.0, 0.05, 0.5, 1.0)
    assert 1 <= expected < 6
    fed = _Offline(_config(tmp_path, rounds=8, target_epsilon=2.0), datas)
    for _ in range(expected + 1):
        fed.round()
    assert fed.coord.done_round == expected and fed.coord._done
    assert fed.coord.budget_stop is not None and f"round {expected + 1} would bring" in fed.coord.budget_stop
    assert fed.plans[-1].phase == "final"
    assert fed.coord.privacy.epsilon() <= 2.0


@pytest.mark.parametrize("bad, needle", [
    ({"population": None}, "population is required"),
    ({"delta": 0.3}, "delta must be in (0, 1/N)"),
])
def test_the_coordinator_refuses_privacy_it_cannot_state(tmp_path, bad, needle):
    with pytest.raises(CoordinatorError, match="privacy") as exc:
        Coordinator(_config(tmp_path, **bad), CREDS)
    assert needle in str(exc.value)


def test_asynchronous_versions_are_composed_without_amplification(digits):
    """Which devices fill a buffer depends on their speed, not a draw: every version composes at q = 1 and
    the fixed denominator is the buffer."""
    from coordinator.privacy import FederationPrivacy
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    fp, _ = FederationPrivacy.of(PrivacySettings(enabled=True, population=100, noise_multiplier=1.0), strategy,
                                 quorum=10, buffer=4, asynchronous=True)
    assert fp is not None
    rp = fp.round(asked=12)
    assert rp.contributions == 4 and fp.q == 1.0
    sync, _ = FederationPrivacy.of(PrivacySettings(enabled=True, population=100, noise_multiplier=1.0), strategy,
                                   quorum=10, buffer=4, asynchronous=False)
    assert sync is not None and sync.round(asked=13).contributions == 10 and sync.q == 0.13


def test_the_coordinator_refuses_secure_rounds_it_cannot_run(tmp_path):
    from flayer.config import ConfigError

    _config(tmp_path, secure_aggregation=True)  # synchronous, quorum 2: fine
    text = (tmp_path / "federation.toml").read_text()
    for change, needle in (("quorum = 2", "quorum = 1"), ("grace_s = 0.0", 'grace_s = 0.0\nmode = "async"'),
                           ("secure_aggregation = true", "secure_aggregation = true\nsecure_stage_s = 25.0")):
        (tmp_path / "federation.toml").write_text(text.replace(*((change, needle))))
        with pytest.raises(ConfigError, match="secure_aggregation needs|3 x secure_stage_s <= deadline_s"):
            load_coordinator_config(tmp_path / "federation.toml")
