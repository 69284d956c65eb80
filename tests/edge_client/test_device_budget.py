"""A device's own privacy ledger (edge_client.budget): the epsilon it composes is the accountant's at q = 1, the
ledger counts a round once, a malformed ledger or a budget without a delta refuses, the multiplier is the one
that protects the contribution from who sees it, and device.toml's [privacy] table is validated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_client.budget import (BUDGET_SPENT, LEDGER_KEY, ROUND_SKIPPED, DeviceBudgets, DeviceLedger,
                                 contribution_multiplier)
from edge_client.config import load_device_config
from flayer.config import ConfigError
from flayer.engine.accountant import epsilon_for
from flayer.engine.privacy import RoundPrivacy


def test_the_devices_epsilon_is_the_accountants_at_q_1() -> None:
    led = DeviceLedger([(1.0, 2), (2.0, 3)], 5)
    assert led.epsilon(1e-6) == epsilon_for([(1.0, 1.0, 2), (2.0, 1.0, 3)], 1e-6)
    assert led.epsilon(1e-6, (1.0, 1)) == epsilon_for([(1.0, 1.0, 2), (2.0, 1.0, 3), (1.0, 1.0, 1)], 1e-6)
    assert DeviceLedger().epsilon(1e-6) == 0.0


def test_the_ledger_counts_each_round_once_and_round_trips() -> None:
    led = DeviceLedger()
    for r, z in ((1, 1.0), (1, 1.0), (2, 1.0), (4, 2.0)):
        led.record(z, r)
    assert led.rounds == 3 and led.runs == [(1.0, 2), (2.0, 1)]
    again = DeviceLedger.from_extra({LEDGER_KEY: led.state()})
    assert again == led
    for bad in ({"runs": [[1.0, 0]], "last_round": 1}, {"runs": "x", "last_round": 1}, {"runs": [[-1, 1]],
                                                                                          "last_round": 1}):
        with pytest.raises(ValueError, match="ledger"):
            DeviceLedger.from_extra({LEDGER_KEY: bad})


def test_the_multiplier_is_what_protects_the_contribution_from_who_sees_it() -> None:
    central = RoundPrivacy("central", 1.0, 1.2, 1.2, 16)
    local = RoundPrivacy("local", 1.0, 1.2, 1.2, 16)
    assert contribution_multiplier(central, False) == 1.2
    # the named noise, not the label: labelled 1.2, the update noise it names is 1.0
    assert contribution_multiplier(RoundPrivacy("central", 1.0, 1.2, 1.0, 16), False) == 1.0
    zd = 0.75 ** -0.5  # adaptive at z 1, sigma_b 2: z_Delta; and with the bit noise shrunk, far less than the label
    assert contribution_multiplier(RoundPrivacy("central", 1.0, 1.0, zd, 16, True, 2.0), False) == pytest.approx(1.0)
    assert contribution_multiplier(RoundPrivacy("central", 1.0, 1.0, zd, 16, True, 1e-9), False) < 1e-8
    assert contribution_multiplier(local, False) == pytest.approx(0.3)  # the coordinator sees its share alone
    assert contribution_multiplier(local, True) == 1.2  # with secure aggregation: the sum


def _device(tmp: Path, budget: float, delta: float, extra: dict[str, Any]) -> Any:
    dev = SimpleNamespace(id="dev-1", settings=SimpleNamespace(device_budget=budget, device_delta=delta),
                          stored=SimpleNamespace(extra=extra), skipped={}, _heartbeat_at=5.0,
                          _budget_state=(None, False))
    for name in ("_ledger", "_own_privacy", "_budget_refuses", "_noise_problem", "_budget_problem", "_schema_problem", "_pinned_schema",
                 "_record_contribution", "_privacy_status"):
        setattr(dev, name, getattr(DeviceBudgets, name).__get__(dev))
    return dev


def _plan(round_: int, **extra: Any) -> Any:
    return SimpleNamespace(round=round_, phase="train", secure={}, selected=("dev-1", "dev-2", "dev-3", "dev-4"), mode="sync",
                           privacy={**RoundPrivacy("central", 1.0, 1.0, 1.0, 4).as_plan(), **extra})


def test_refusals_without_a_delta_past_the_budget_and_with_a_bad_ledger(tmp_path: Path) -> None:
    one = epsilon_for([(1.0, 1.0, 1)], 1e-3)
    small = _device(tmp_path, epsilon_for([(1.0, 1.0, 1)], 1e-5) * 0.9, 0.0, {})
    assert small._budget_refuses(_plan(1))  # no delta named: the device counts at DEVICE_DELTA = 1e-5
    assert small._budget_refuses(_plan(1, delta=0.5))  # a plan cannot raise it
    # one round alone is past the budget: the plan is refused, the budget is not spent (nothing was contributed)
    assert small.skipped[1] == ROUND_SKIPPED and small._heartbeat_at == 0.0 and small._privacy_status() == {}
    dev = _device(tmp_path, one * 1.5, 1e-3, {})
    assert not dev._budget_refuses(_plan(2, delta=1e-3))
    dev._record_contribution(_plan(2).privacy, False, 2)
    assert dev._budget_refuses(_plan(3, delta=1e-3))  # a second one would pass 1.5 x one round's
    assert dev.skipped[3] == BUDGET_SPENT
    assert dev._privacy_status() == {"dp_rounds": 1, "dp_at_budget": True, "dp_epsilon": pytest.approx(one)}
    assert dev._budget_refuses(_plan(3, delta=1e-3, device_budget=one * 3))  # the smaller budget wins
    dev.stored.extra[LEDGER_KEY] = {"runs": "garbage"}
    assert dev._budget_refuses(_plan(4, delta=1e-3))
    free = _device(tmp_path, 0.0, 0.0, {})
    assert not free._budget_refuses(_plan(1, delta=1e-3))
    assert free._budget_refuses(_plan(1, delta=1e-3, device_budget=one / 2))  # the plan's budget alone


def test_device_toml_privacy_table(tmp_path: Path) -> None:
    base = 'credentials = "c.toml"\n[data]\nsource = "arrays"\npath = "x.npz"\n'
    (tmp_path / "a.toml").write_text(base + "[privacy]\ndevice_budget = 4.0\ndelta = 1e-5\n")
    edge = load_device_config(tmp_path / "a.toml").edge
    assert (edge.device_budget, edge.device_delta) == (4.0, 1e-5)
    for bad in ("device_budget = -1.0", "delta = 1.5", "epsilon = 3.0"):
        (tmp_path / "b.toml").write_text(base + f"[privacy]\n{bad}\n")
        with pytest.raises(ConfigError, match="privacy|device_budget|delta"):
            load_device_config(tmp_path / "b.toml")


def test_a_malformed_private_plan_is_refused_without_a_budget_too(tmp_path: Path) -> None:
    dev = _device(tmp_path, None, 0.0, {})  # type: ignore[arg-type]
    assert dev._budget_refuses(_plan(1, delta="1e-3"))
    assert dev.skipped[1] == "round skipped"
    assert not dev._budget_refuses(_plan(2))


def test_device_toml_pins_a_participation_schema(tmp_path: Path) -> None:
    base = 'credentials = "c.toml"\n[data]\nsource = "arrays"\npath = "x.npz"\n'
    (tmp_path / "a.toml").write_text(base + "[privacy]\nmax_participations = 2\nmin_separation = 3\n")
    edge = load_device_config(tmp_path / "a.toml").edge
    assert (edge.max_participations, edge.min_separation) == (2, 3)
    for bad in ("max_participations = -1", "min_separation = 1.5", "max_participations = true"):
        (tmp_path / "b.toml").write_text(base + f"[privacy]\n{bad}\n")
        with pytest.raises(ConfigError, match="max_participations|min_separation"):
            load_device_config(tmp_path / "b.toml")


def test_schema_problem_reads_the_plan_the_ledger_and_the_pinned_floor() -> None:
    from edge_client.budget import schema_problem
    from flayer.privacy_config import ParticipationSchema as S

    plan = {"max_participations": 2, "min_separation": 3}
    assert schema_problem(plan, S(), 0, 0, 1) is None
    assert "max_participations = 2" in schema_problem(plan, S(), 2, 4, 9)  # a third
    assert "min_separation = 3" in schema_problem(plan, S(), 1, 4, 6)  # two rounds after its last
    # round 4 is in the ledger already: never trained again (a re-sent upload does not come here)
    assert "contributed to once" in schema_problem(plan, S(), 2, 4, 4)
    assert "contributed to once" in schema_problem({}, S(), 1, 4, 4)  # with no schema too
    assert "looser" in schema_problem({}, S(2, 3), 0, 0, 1)  # absent while pinned
    assert "looser" in schema_problem({"max_participations": 3, "min_separation": 3}, S(2, 3), 0, 0, 1)
    assert "looser" in schema_problem({"max_participations": 2, "min_separation": 2}, S(2, 3), 0, 0, 1)
    assert schema_problem({"max_participations": 5}, S(), 4, 1, 2) is None  # no pin: the plan's own k
    assert "max_participations = 1" in schema_problem({"max_participations": 1, "min_separation": 3}, S(2, 3),
                                                      1, 1, 9)  # the tighter of the two
    with pytest.raises(ValueError, match="max_participations"):
        schema_problem({"max_participations": "2"}, S(), 0, 0, 1)


def test_a_plan_is_refused_on_what_the_device_would_book_not_on_its_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floors a device computes from the signed plan: its own share's multiplier (z / sqrt(m) in local mode
    without a secure sum) at least MIN_MULTIPLIER, m no more than the devices a synchronous plan selects and below
    1 / delta, and a finite one-round epsilon."""
    from edge_client import budget
    from edge_client.budget import contributions_problem, plan_noise_problem, plan_problem

    vanishing = RoundPrivacy("local", 0.5, 1.0, 1.0, 10**8)
    assert "0.0001" in (plan_noise_problem(vanishing, False) or "") and "below 0.01" in plan_noise_problem(vanishing, False)
    assert plan_noise_problem(vanishing, True) is None  # in a secure sum the device books z: the sum's noise
    assert plan_noise_problem(RoundPrivacy("local", 0.5, 1.0, 1.0, 10**4), False) is None  # 1 / sqrt(10^4) = 0.01
    assert plan_noise_problem(RoundPrivacy("central", 0.5, 1.0, 1.0, 10**8), False) is None  # central: z itself
    assert contributions_problem(vanishing, "sync", 2, None) is not None
    assert contributions_problem(RoundPrivacy("local", 0.5, 1.0, 1.0, 2), "sync", 2, 1e-3) is None
    assert contributions_problem(RoundPrivacy("local", 0.5, 1.0, 1.0, 3), "sync", 2, 1e-3) is not None
    assert contributions_problem(RoundPrivacy("local", 0.5, 1.0, 1.0, 999), "async", 2, 1e-3) is None  # buffer
    assert "1 / delta" in (contributions_problem(RoundPrivacy("local", 0.5, 1.0, 1.0, 1000), "async", 2, 1e-3) or "")
    plan = _plan(1, delta="x")  # a malformed delta names itself
    assert "delta" in (plan_problem(plan, RoundPrivacy.from_plan(plan.privacy)) or "")  # type: ignore[arg-type]
    monkeypatch.setattr(budget, "epsilon_for", lambda runs, delta: float("inf"))  # an accountant that gives up
    assert "epsilon inf" in (plan_noise_problem(RoundPrivacy("central", 0.5, 1.0, 1.0, 4), False) or "")
