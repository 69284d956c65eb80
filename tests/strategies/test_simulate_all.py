"""Every baseline through the one simulator on digits, and the calibration phase end to end."""

from __future__ import annotations

import json
import math

import pytest

from flayer.simulation import simulate
from flayer.engine import calibrate, initial_global_state
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.update import float_state

METHODS = ["local", "fedavg", "fedper", "fedrep", "lgfedavg", "ditto", "fedala", "fedbabu", "playerfl"]


# playerfl's two simulated rounds run again in test_calibration_end_to_end (its calibration, its upload size):
# slow here (-m slow; CI runs it)
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "playerfl" else m
                                    for m in METHODS])
def test_two_rounds_through_simulate(method, digits_spec, train_cfg, digits_clients):
    strategy = make_strategy(method, digits_spec, train_cfg)
    result = simulate(strategy, digits_clients, 2, seed=0)
    assert [r.round for r in result.rounds] == [1, 2]
    for r in result.rounds:
        assert 0.0 <= r.acc <= 1.0 and len(r.client_acc) == len(digits_clients)
        assert r.indexed == 0  # dense uploads
    assert 0.0 <= result.final_acc <= 1.0 and len(result.final_client_acc) == len(digits_clients)
    full = sum(v.numel() for v in float_state(strategy.new_model()).values())
    sent = result.rounds[0].sent
    if method == "local":
        assert sent == 0 and result.global_state.keys() == result.global_state.keys()
    elif method in ("fedavg", "ditto", "fedala"):
        assert sent == full * len(digits_clients)
    else:
        assert 0 < sent < full * len(digits_clients)
    assert (result.calibration != {}) == (method == "playerfl")


def test_local_never_changes_the_server_model(digits_spec, train_cfg, digits_clients):
    strategy = make_strategy("local", digits_spec, train_cfg)
    g0 = initial_global_state(strategy, 0)
    result = simulate(strategy, digits_clients, 2, seed=0)
    assert all((result.global_state[k] == g0[k]).all() for k in g0)


def test_calibration_end_to_end(digits_spec, train_cfg, digits_clients):
    strategy = make_strategy("playerfl", digits_spec, train_cfg)
    assert strategy.needs_calibration()
    g = initial_global_state(strategy, 0)
    # the client half: one report per client, plain finite floats, JSON-serialisable
    reports = [strategy.calibrate(g, d, RoundContext(0, i, 0)) for i, d in enumerate(digits_clients)]
    for rep in reports:
        assert list(rep) == ["layer.1", "layer.2", "layer.3", "layer.4"]
        assert all(math.isfinite(v) and v >= 0 for v in rep.values())
        assert list(rep.values()) == sorted(rep.values())  # cumulative
    wire = [json.loads(json.dumps(r)) for r in reports]
    resolved = strategy.resolve_calibration(wire, [d.num_train for d in digits_clients])
    assert set(resolved) == {"split"} and 0 <= resolved["split"] <= 4
    configured = strategy.with_options(resolved)
    assert not configured.needs_calibration() and configured.options.split == resolved["split"]
    # the simulator's round 0 reaches the same decision and runs the configured strategy
    _, resolved2 = calibrate(strategy, digits_clients, g, seed=0)
    assert resolved2 == resolved
    result = simulate(strategy, digits_clients, 2, seed=0)
    assert result.calibration == resolved
    shared = sum(v.numel() for n, v in g.items() if n not in configured.local_part)
    assert result.rounds[0].sent == shared * len(digits_clients)


def test_no_calibration_by_default(digits_spec, train_cfg):
    for method in METHODS:
        s = make_strategy(method, digits_spec, train_cfg, {"split": 3} if method == "playerfl" else None)
        assert not s.needs_calibration()
        if method != "playerfl":
            assert s.resolve_calibration([], []) == {}
    with pytest.raises(ValueError, match="no calibration reports"):
        make_strategy("playerfl", digits_spec, train_cfg).resolve_calibration([], [])
    with pytest.raises(NotImplementedError):
        make_strategy("fedavg", digits_spec, train_cfg).calibrate({}, None, RoundContext(0, 0, 0))
