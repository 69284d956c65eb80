"""Per method: which tensors the download overwrites, which tensors are uploaded, what the client keeps.

The global model is filled with 1.0 and the client's kept personal tensors with 2.0, so after
``receive`` a tensor still equal to 1.0 was overwritten by the download and one equal to 2.0 was kept.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flayer.strategies import STRATEGIES, make_strategy
from flayer.strategies.base import RoundContext
from flayer.update import float_state

CONV = {"conv1.0.weight", "conv1.0.bias", "conv2.0.weight", "conv2.0.bias"}
FC1 = {"fc1.0.weight", "fc1.0.bias"}
HEAD = {"fc.weight", "fc.bias"}
ALL = CONV | FC1 | HEAD
BODY = CONV | FC1

# method: (options, overwritten on download, uploaded, kept as personal.<name>)
EXPECTED = {
    "fedavg": ({}, ALL, ALL, set()),
    "local": ({}, set(), set(), ALL),
    "fedper": ({}, BODY, BODY, HEAD),
    "fedrep": ({}, BODY, BODY, HEAD),
    "lgfedavg": ({}, HEAD, HEAD, BODY),
    "ditto": ({}, set(), ALL, ALL),
    "fedbabu": ({}, ALL, BODY, set()),
    "playerfl": ({"split": 2}, CONV, CONV, FC1 | HEAD),
    # FedALA: lower tensors <- global; the top p=2 (the head) are mixed, checked in test_fedala.py
    "fedala": ({}, BODY, ALL, ALL),
}


def test_every_registered_baseline_is_covered():
    assert set(EXPECTED) <= set(STRATEGIES)
    assert set(STRATEGIES) - set(EXPECTED) <= {"flayer", "flayer-ref"}


def _filled(names, value, like):
    return {n: torch.full_like(like[n], value) for n in names}


@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_download_upload_and_kept_sets(method, digits_spec, train_cfg, digits_clients):
    options, overwritten, uploaded, kept = EXPECTED[method]
    strategy = make_strategy(method, digits_spec, train_cfg, options)
    template = float_state(strategy.new_model())
    assert set(template) == ALL
    global_state = _filled(ALL, 1.0, template)
    state = strategy.initial_state()
    # a returning client: its kept personal copies (2.0); FedALA with W = ones
    state.tensors.update({f"personal.{n}": v for n, v in _filled(kept, 2.0, template).items()})
    state.scalars["ala_started"] = 1
    data = digits_clients[0]
    ctx = RoundContext(round=5, client=0, seed=0)

    model = strategy.receive(global_state, state, data, ctx)
    got = float_state(model)
    from_global = {n for n, v in got.items() if torch.all(v == 1.0)}
    from_client = {n for n, v in got.items() if torch.all(v == 2.0)}
    assert from_global == overwritten
    if method == "fedala":
        assert from_client == set()  # the head is a mix of both (W learned away from ones)
    else:
        assert from_client == ALL - overwritten == kept

    result = strategy.local_round(model, global_state, state, data, ctx)
    assert set(result.update.deltas) == uploaded
    assert result.update.num_samples == data.num_train
    trained = float_state(model)
    for n, d in result.update.deltas.items():
        assert d.indices is None  # baselines upload whole tensors
        personal_delta = (trained[n] - global_state[n]).numpy()
        if method == "ditto":  # uploads its separately trained copy of the global model, not the personal one
            assert not np.allclose(d.to_dense(), personal_delta)
        else:
            np.testing.assert_allclose(d.to_dense(), personal_delta, rtol=1e-6, atol=1e-6)
    assert set(result.state.prefixed("personal.")) == kept
    for n in kept:
        assert torch.equal(result.state.tensors[f"personal.{n}"], trained[n])


@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_first_round_starts_from_the_common_model(method, digits_spec, train_cfg, digits_clients):
    """A client that has never participated evaluates and trains the global (common initial) model."""
    options = EXPECTED[method][0]
    strategy = make_strategy(method, digits_spec, train_cfg, options)
    torch.manual_seed(0)
    global_state = float_state(strategy.new_model())
    model = strategy.receive(global_state, strategy.initial_state(), digits_clients[1], RoundContext(1, 1, 0))
    for n, v in float_state(model).items():
        assert torch.equal(v, global_state[n]), n


def test_frozen_parts_do_not_move(digits_spec, train_cfg, digits_clients):
    """FedBABU never trains its head; FedRep's uploaded body and kept head both train."""
    torch.manual_seed(1)
    babu = make_strategy("fedbabu", digits_spec, train_cfg)
    g = float_state(babu.new_model())
    model = babu.receive(g, babu.initial_state(), digits_clients[0], RoundContext(1, 0, 0))
    babu.local_round(model, g, babu.initial_state(), digits_clients[0], RoundContext(1, 0, 0))
    after = float_state(model)
    assert all(torch.equal(after[n], g[n]) for n in HEAD)
    assert all(not torch.equal(after[n], g[n]) for n in CONV | FC1)
    rep = make_strategy("fedrep", digits_spec, train_cfg)
    model = rep.receive(g, rep.initial_state(), digits_clients[0], RoundContext(1, 0, 0))
    res = rep.local_round(model, g, rep.initial_state(), digits_clients[0], RoundContext(1, 0, 0))
    after = float_state(model)
    assert all(not torch.equal(after[n], g[n]) for n in ALL)
    assert np.isfinite(res.metrics["head_loss"]) and np.isfinite(res.metrics["train_loss"])


def test_options_are_validated(digits_spec, train_cfg):
    from flayer.config import ConfigError

    with pytest.raises(ValueError, match="head_layers = 9"):
        make_strategy("fedper", digits_spec, train_cfg, {"head_layers": 9})
    with pytest.raises(ConfigError, match="mu must be >= 0"):
        make_strategy("ditto", digits_spec, train_cfg, {"mu": -1.0})
    with pytest.raises(ConfigError, match="unknown key"):
        make_strategy("fedala", digits_spec, train_cfg, {"p": 2})
    with pytest.raises(ValueError, match="split = 7"):
        make_strategy("playerfl", digits_spec, train_cfg, {"split": 7})
