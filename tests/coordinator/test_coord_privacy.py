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
from protocol import SigningKey, Status, Topics, WireLimits, decode_update
from protocol.metrics_schema import read_metrics
from transport.credentials import Credentials
from transport.link import Received

DEVICES = ["dev-0", "dev-1", "dev-2", "dev-3"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
PRIVACY = {"enabled": True, "population": 4, "clip": 0.3, "noise_multiplier": 1.0, "delta": 0.05}


def _config(tmp: Path, rounds: int = 3, quorum: int = 2, **privacy: Any) -> Any:
    table = {k: v for k, v in {**PRIVACY, **privacy}.items() if v is not None}  # None: the key left out
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 4",
             f"quorum = {quorum}", "extend_s = 0.0",
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
        setattr(c.publishing, "model", lambda round_, rnd: setattr(c.publishing, "chunks", 1))  # noqa: B010 -- no broker
        setattr(c.publishing, "publish_plan", lambda phase, rnd, cal=None: self._record(c.publishing.plan(phase, rnd, cal)))  # noqa: B010
        setattr(c.publishing.publisher, "clear_old_models", lambda: 0)  # noqa: B010
        setattr(c.publishing.publisher, "plan", self._record)  # noqa: B010
        setattr(c.inbox, "ack", lambda *a, **k: None)  # noqa: B010
        c.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        c.cycle.restore()
        self.keys = {d: SigningKey.generate() for d in DEVICES}  # the devices' keys, as the broker's registry has them
        c.device_keys.keys = {d: k.public for d, k in self.keys.items()}
        for d in DEVICES:
            c.registry.observe(d, Status(0, "online", self.now), self.now)
        self.cache = StrategyCache({"lr": 0.05, "batch_size": 10, "local_epochs": 1, "device": "cpu"})
        self.states: dict[str, Any] = {d: None for d in DEVICES}
        self.folded: list[tuple[int, list[Any]]] = []

    def _record(self, plan: Any) -> int:
        self.plans.append(plan)
        return 0

    def round(self, uploads: int | None = None) -> None:
        """Open a round, let every selected device (or the first ``uploads`` of them) train and upload, close it
        (at quorum, or at the deadline when fewer upload)."""
        c = self.coord
        c._tick()
        if c.open is None:
            return
        plan = self.plans[-1]
        strategy = self.cache.get(plan)
        g = {k: v.clone() for k, v in c.global_state.items()}
        decoded = []
        for dev in sorted(plan.selected)[:uploads]:
            i = DEVICES.index(dev)
            state = self.states[dev] or strategy.initial_state()
            up = train_and_encode(strategy, plan, g, state, self.datas[i], round_context(plan, i, torch.device("cpu")),
                                  federation="utest", sender=dev, max_payload=1 << 20, max_update_bytes=0, amp=False,
                                  key=self.keys[dev])
            self.states[dev] = up.state
            decoded.append(decode_update(up.blob, WireLimits(), dict(c.open.aggregate.shapes)).update)
            for k, payload in enumerate(up.payloads):
                c.intake.on_message(Received(Topics("utest").update_chunk(dev, plan.round, k), payload, False))
        self.folded.append((plan.round, decoded))
        self.now += 1.0 if uploads is None else 61.0  # past the 60 s deadline
        c._tick()  # quorum (every selected device) and no grace: the round closes

    def close(self) -> None:
        setattr(self.coord, "_shut_down", lambda: None)  # noqa: B010
        self.coord.metrics.close()
        self.coord.state_lock.release()  # as a stopped coordinator's process would


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
    # the plan lists the cohort: every round at q = 1, against readers of the models and plans
    assert [rec["epsilon"] for rec in rounds] == pytest.approx([epsilon_for([(1.0, 1.0, t)], 0.05) for t in (1, 2, 3)])
    assert rounds[0]["dp_sample_rate"] == 1.0 and rounds[0]["dp_clip"] == 0.3
    assert all(rec["epsilon_coordinator"] == "inf" for rec in rounds)  # central: the coordinator sees the updates


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
    ckpt = load_checkpoint(split_dir / "coord", first.coord.cycle.identity())
    assert ckpt is not None and ckpt.privacy["ledger"] == [[1.0, 1.0, 2]]
    again = _Offline(_config(split_dir, rounds=3), datas)
    assert again.coord.privacy.accounts.public.rounds == 2  # not forgotten
    again.states = first.states
    again.round()
    again.close()
    assert again.coord.privacy.accounts.public.rounds == 3  # and not composed twice
    assert again.coord.privacy.epsilon() == whole.coord.privacy.epsilon()
    last = [rec for rec in read_metrics(split_dir / "coord" / "metrics.jsonl") if rec["kind"] == "round"][-1]
    assert last["round"] == 3 and last["epsilon"] == pytest.approx(whole.coord.privacy.epsilon())


def test_target_epsilon_ends_the_federation_before_the_budget(tmp_path, datas):
    expected = rounds_for_target(4.0, 0.05, 1.0, 1.0)
    assert 1 <= expected < 6
    fed = _Offline(_config(tmp_path, rounds=8, target_epsilon=4.0), datas)
    for _ in range(expected + 1):
        fed.round()
    assert fed.coord.done_round == expected and fed.coord.cycle.finished
    assert fed.coord.cycle.budget_stop is not None and f"round {expected + 1} would bring" in fed.coord.cycle.budget_stop
    assert fed.plans[-1].phase == "final"
    assert fed.coord.privacy.epsilon() <= 4.0


@pytest.mark.parametrize("bad, needle", [
    ({"population": None}, "population is required"),
    ({"delta": 0.3}, "delta must be in (0, 1/N)"),
])
def test_the_coordinator_refuses_privacy_it_cannot_state(tmp_path, bad, needle):
    with pytest.raises(CoordinatorError, match="privacy") as exc:
        Coordinator(_config(tmp_path, **bad), CREDS)
    assert needle in str(exc.value)


def test_synchronous_rounds_and_asynchronous_versions_compose_at_q_1(digits):
    """Plans list the cohort, and the buffer fills by speed: no adversary is unsure who took part, so every
    round and version composes at q = 1 (asked 13 of 100 spends what asked 100 of 100 would)."""
    from coordinator.privacy import FederationPrivacy
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    for asynchronous, m in ((True, 4), (False, 10)):
        fp, _ = FederationPrivacy.of(PrivacySettings(enabled=True, population=100, noise_multiplier=1.0), strategy,
                                     quorum=10, buffer=4, asynchronous=asynchronous)
        assert fp is not None and fp.round(asked=13).contributions == m
        assert fp.over_budget(1, 13) is None and fp.delta == 1e-5
        agg = OpenAggregate(strategy, {k: v.clone() for k, v in strategy.new_model().state_dict().items()},
                            fp.round(asked=13))
        agg.tally.accepted = m
        fp.close(agg)
        assert fp.accounts.public.history == [(1.0, 1.0, 1)]
        assert fp.epsilon() == pytest.approx(epsilon_for([(1.0, 1.0, 1)], 1e-5))


def test_a_checkpoint_whose_ledger_composes_more_than_was_done_is_refused_in_both_modes(digits):
    """A checkpoint after version 2 (or round 2) whose ledger composes 3 is not restored: asynchronous runs were
    let through before."""
    from coordinator.privacy import FederationPrivacy, PrivacyStateError
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    raw = {"ledger": [[1.0, 1.0, 3]], "coordinator_ledger": None, "clip": 0.3}
    for asynchronous in (True, False):
        fp, _ = FederationPrivacy.of(PrivacySettings(enabled=True, population=100, noise_multiplier=1.0), strategy,
                                     quorum=10, buffer=4, asynchronous=asynchronous)
        assert fp is not None
        with pytest.raises(PrivacyStateError, match="composes 3 rounds"):
            fp.restore(raw, 2)
        fp.restore(raw, 3)
        assert fp.accounts.public.rounds == 3


def test_a_local_round_that_closes_short_is_composed_with_the_noise_that_arrived(tmp_path, datas):
    """Local noise: 3 devices asked, shares sized for m = 3, only 2 upload before the deadline. The sum carries
    z sqrt(2/3) of noise, and that is what the round spends (against readers of the models and plans); the
    coordinator, which sees each upload with its own share, faces z / sqrt(3) per device."""
    fed = _Offline(_config(tmp_path, rounds=2, quorum=3, mode='"local"'), datas)
    fed.round(uploads=2)
    fed.close()
    (rec,) = [r for r in read_metrics(tmp_path / "coord" / "metrics.jsonl") if r["kind"] == "round"]
    assert rec["accepted"] == 2
    z_sum = 1.0 * np.sqrt(2 / 3)
    assert rec["dp_noise_multiplier"] == pytest.approx(z_sum)
    assert rec["epsilon"] == pytest.approx(epsilon_for([(z_sum, 1.0, 1)], 0.05))
    assert rec["epsilon"] > epsilon_for([(1.0, 1.0, 1)], 0.05)  # more than the planned z would say
    assert rec["epsilon_coordinator"] == pytest.approx(epsilon_for([(1.0 / np.sqrt(3), 1.0, 1)], 0.05))
    # the budget check before a round assumes the fewest uploads it may close with (min_updates = 1)
    assert fed.coord.privacy.accounts.worst_z(fed.coord.privacy.round(3), 1) == pytest.approx(1 / np.sqrt(3))


def test_the_coordinator_refuses_secure_rounds_it_cannot_run(tmp_path):
    from flayer.config import ConfigError

    _config(tmp_path, quorum=3, secure_aggregation=True)  # synchronous, quorum 3: fine
    text = (tmp_path / "federation.toml").read_text()
    for change, needle in (("quorum = 3", "quorum = 2"), ("grace_s = 0.0", 'grace_s = 0.0\nmode = "async"'),
                           ("secure_aggregation = true", "secure_aggregation = true\nsecure_stage_s = 25.0")):
        (tmp_path / "federation.toml").write_text(text.replace(*((change, needle))))
        with pytest.raises(ConfigError, match="secure_aggregation needs|3 x secure_stage_s <= deadline_s"):
            load_coordinator_config(tmp_path / "federation.toml")


def test_a_checkpoint_whose_coordinator_ledger_was_emptied_is_refused(digits):
    """Local mode: the coordinator composes every round it saw; a checkpoint whose coordinator ledger holds fewer
    rounds than the public one (emptied, its epsilon against the coordinator reset to 0) is not restored."""
    from coordinator.privacy import FederationPrivacy, PrivacyStateError
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    fp, _ = FederationPrivacy.of(PrivacySettings(enabled=True, mode="local", population=100, noise_multiplier=1.0),
                                 strategy, quorum=10, buffer=4, asynchronous=False)
    assert fp is not None
    with pytest.raises(PrivacyStateError, match="coordinator's composes 0 rounds"):
        fp.restore({"ledger": [[1.0, 1.0, 3]], "coordinator_ledger": [], "clip": 0.3}, 3)
    fp.restore({"ledger": [[1.0, 1.0, 3]], "coordinator_ledger": [[0.316, 1.0, 3]], "clip": 0.3}, 3)
    assert fp.accounts.epsilons(1e-5)["coordinator"] > fp.epsilon()


def test_a_lossy_value_codec_is_refused_with_privacy(tmp_path):
    """A lossy codec moves an honest clipped upload just past C after decoding, and the coordinator's count of the
    updates it clips again would then count honest devices (int8: 6 of 8 in one round): refused at load."""
    from coordinator.config import ConfigError

    _config(tmp_path)  # fp32: fine
    text = (tmp_path / "federation.toml").read_text().replace("[federation]\n", '[federation]\nvalue_codec = "int8"\n')
    (tmp_path / "federation.toml").write_text(text)
    with pytest.raises(ConfigError, match="value_codec = 'int8' with \\[privacy\\]"):
        load_coordinator_config(tmp_path / "federation.toml")


def test_the_participation_schema_selects_publicly_survives_a_restart_and_ends_the_federation(tmp_path, datas):
    """max_participations 1 over 4 devices, 2 a round: rounds 1 and 2 select disjoint cohorts (across a restart:
    the checkpoint holds the cohorts), round 3 has nobody the schema allows and the federation ends saying so;
    the plans carry the schema, and epsilon is one round's (the schema's worst case), not two."""
    first = _Offline(_config(tmp_path, rounds=3, max_participations=1), datas)
    first.round()
    first.close()
    again = _Offline(_config(tmp_path, rounds=3, max_participations=1), datas)
    again.states = first.states
    again.round()
    cohorts = [set(p.selected) for p in first.plans + again.plans if p.phase == "train"]
    assert len(cohorts) >= 2 and len(cohorts[0]) == 2 and cohorts[0].isdisjoint(cohorts[-1]), cohorts
    assert first.plans[0].privacy["max_participations"] == 1 and first.plans[0].privacy["min_separation"] == 0
    again.round()
    assert again.coord.cycle.finished and again.coord.done_round == 2
    assert again.coord.cycle.budget_stop is not None and "participation schema: round 3" in again.coord.cycle.budget_stop
    assert again.coord.privacy.accounts.public.rounds == 2
    assert again.coord.privacy.epsilon() == pytest.approx(epsilon_for([(1.0, 1.0, 1)], 0.05))
    again.close()


@pytest.mark.parametrize("bad, needle", [
    ({"max_participations": 0}, "max_participations must be an integer >= 1"),
    ({"min_separation": -1}, "min_separation must be an integer"),
])
def test_the_coordinator_refuses_a_malformed_schema(tmp_path, bad, needle):
    with pytest.raises(Exception, match="privacy") as exc:
        Coordinator(_config(tmp_path, **bad), CREDS)
    assert needle in str(exc.value)


def test_the_schema_needs_synchronous_rounds_and_privacy(digits):
    """Asynchronous slots are not drawn round by round, and a schema without noise bounds nothing: refused."""
    from coordinator.privacy import FederationPrivacy
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    with pytest.raises(ValueError, match="synchronous rounds"):
        FederationPrivacy.of(PrivacySettings(enabled=True, population=100, max_participations=2), strategy,
                             quorum=10, buffer=4, asynchronous=True)
    with pytest.raises(ValueError, match="need enabled = true"):
        FederationPrivacy.of(PrivacySettings(population=100, min_separation=3), strategy, quorum=10, buffer=4,
                             asynchronous=False)


def test_expected_contributions_above_a_synchronous_quorum_is_refused(digits):
    """A synchronous round may select as few as quorum devices, and a device refuses a plan whose m exceeds the
    devices it selects (edge_client.budget.contributions_problem): the coordinator refuses such m at the start;
    an asynchronous buffer may exceed the devices training at once."""
    from coordinator.privacy import FederationPrivacy
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    settings = PrivacySettings(enabled=True, mode="local", population=100, noise_multiplier=1.0,
                               expected_contributions=12)
    with pytest.raises(ValueError, match="expected_contributions 12 exceeds the quorum 10"):
        FederationPrivacy.of(settings, strategy, quorum=10, buffer=4, asynchronous=False)
    fp, _ = FederationPrivacy.of(settings, strategy, quorum=12, buffer=4, asynchronous=False)
    assert fp is not None and fp.round(12).contributions == 12
    fp, _ = FederationPrivacy.of(settings, strategy, quorum=2, buffer=12, asynchronous=True)
    assert fp is not None and fp.round(3).contributions == 12


def test_adaptive_clipping_under_the_schema_composes_k_rounds_of_the_combined_multiplier(digits):
    """Adaptive clipping: each round's sum and clip-bit count are one Gaussian mechanism of multiplier z
    (RoundPrivacy.counted_multiplier); under max_participations 2, five rounds cost a device two of them."""
    from coordinator.privacy import FederationPrivacy
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    settings = PrivacySettings(enabled=True, population=100, noise_multiplier=1.3, clipping="adaptive",
                               max_participations=2)
    fp, _ = FederationPrivacy.of(settings, strategy, quorum=10, buffer=4, asynchronous=False)
    assert fp is not None
    for _ in range(5):
        rp = fp.round(asked=10)
        assert rp.adaptive and rp.counted_multiplier == pytest.approx(1.3)
        agg = OpenAggregate(strategy, {k: v.clone() for k, v in strategy.new_model().state_dict().items()}, rp)
        agg.tally.accepted = 10
        fp.close(agg)
    assert fp.accounts.public.rounds == 5
    assert fp.epsilon() == pytest.approx(epsilon_for([(rp.counted_multiplier, 1.0, 2)], 1e-5))
    assert fp.epsilon() < epsilon_for([(rp.counted_multiplier, 1.0, 5)], 1e-5)


def test_a_round_abandoned_before_its_unmasking_uses_up_no_device_slot_and_survives_a_restart(digits):
    """max_participations 1: a device selected in a secure round abandoned before any unmask request (the plans name
    it in secure.void) is still eligible; a revealed round uses its slot; the void rounds are checkpointed, and
    a checkpoint naming a round after its own is refused."""
    from coordinator.privacy import FederationPrivacy, PrivacyStateError
    from flayer.config import TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05))
    settings = PrivacySettings(enabled=True, population=100, noise_multiplier=1.0, max_participations=1)
    fp, _ = FederationPrivacy.of(settings, strategy, quorum=2, buffer=4, asynchronous=False)
    assert fp is not None
    fp.selected(1, ["a", "b"])
    assert fp.eligible(["a", "b", "c"], 2) == ["c"]  # round 1 not (yet) void: its selections count
    fp.abandoned(1)
    assert fp.eligible(["a", "b", "c"], 2) == ["a", "b", "c"]
    fp.selected(2, ["a", "c"])  # revealed
    assert fp.eligible(["a", "b", "c"], 3) == ["b"]
    again, _ = FederationPrivacy.of(settings, strategy, quorum=2, buffer=4, asynchronous=False)
    assert again is not None
    again.restore(fp.state(), 2)
    assert again.eligible(["a", "b", "c"], 3) == ["b"] and again.void == {1}
    with pytest.raises(PrivacyStateError, match="void_rounds"):
        again.restore({**fp.state(), "void_rounds": [3]}, 2)
