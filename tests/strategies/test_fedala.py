"""FedALA: W stays in [0, 1], is kept across rounds, ALA is skipped in the first round, and the start
phase runs until the loss settles (capped) and one epoch afterwards."""

from __future__ import annotations

import torch

from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.strategies.base import ClientState, RoundContext
from flayer.strategies.fedala import ala_mix
from flayer.update import float_state

TOP = ("fc.weight", "fc.bias")


def _global_and_local(strategy, seed_g=0, seed_l=1):
    torch.manual_seed(seed_g)
    g = float_state(strategy.new_model())
    torch.manual_seed(seed_l)
    local = float_state(strategy.new_model())
    return g, local


def test_weights_in_unit_interval_and_kept_across_rounds(digits_spec, train_cfg, digits_clients):
    # a large eta drives many weights into the clip on both sides
    strategy = make_strategy("fedala", digits_spec, train_cfg, {"eta": 50.0, "max_start_epochs": 4})
    result = simulate(strategy, digits_clients, 3, seed=0)
    for st in result.states:
        assert st.scalars["ala_started"] == 1
        for n in TOP:
            w = st.tensors[f"ala.{n}"]
            assert w.shape == result.global_state[n].shape
            assert float(w.min()) >= 0.0 and float(w.max()) <= 1.0
        w = st.tensors["ala.fc.weight"]
        assert float(w.min()) < 1.0  # learned, not the initial ones
    # only the top p tensors get weights
    assert {k for k in result.states[0].tensors if k.startswith("ala.")} == {f"ala.{n}" for n in TOP}


def test_learning_starts_from_the_kept_weights(digits_spec, train_cfg, digits_clients):
    """With a vanishing eta W barely moves, so the result equals the W the state held (not ones)."""
    strategy = make_strategy("fedala", digits_spec, train_cfg, {"eta": 1e-12})
    g, local = _global_and_local(strategy)
    gen = torch.Generator().manual_seed(3)
    kept = {n: torch.rand(g[n].shape, generator=gen) for n in TOP}
    state = ClientState({**{f"personal.{n}": v for n, v in local.items()},
                         **{f"ala.{n}": v for n, v in kept.items()}}, {"ala_started": 1})
    model = strategy.receive(g, state, digits_clients[0], RoundContext(3, 0, 0))
    for n in TOP:
        torch.testing.assert_close(model.ala_weights[n], kept[n], atol=1e-6, rtol=0)
        torch.testing.assert_close(dict(model.named_parameters())[n].detach(), ala_mix(local[n], g[n], kept[n]))
    res = strategy.local_round(model, g, state, digits_clients[0], RoundContext(3, 0, 0))
    for n in TOP:
        assert torch.equal(res.state.tensors[f"ala.{n}"], model.ala_weights[n])
    assert torch.equal(state.tensors["ala.fc.weight"], kept["fc.weight"])  # receive leaves the input state alone


def test_skipped_in_first_round_and_start_phase_epochs(digits_spec, train_cfg, digits_clients):
    strategy = make_strategy("fedala", digits_spec, train_cfg, {"max_start_epochs": 7})
    g, local = _global_and_local(strategy)
    first = strategy.receive(g, strategy.initial_state(), digits_clients[0], RoundContext(1, 0, 0))
    assert not hasattr(first, "ala_weights")
    assert all(torch.equal(v, g[n]) for n, v in float_state(first).items())

    ones = {n: torch.ones_like(g[n]) for n in TOP}
    model = strategy.model_from(g, torch.device("cpu"))
    ctx = RoundContext(2, 0, 0)
    _, start_losses = strategy.learn_weights(model, g, local, ones, digits_clients[0], ctx, start=True)
    _, later_losses = strategy.learn_weights(model, g, local, ones, digits_clients[0], ctx, start=False)
    # start phase: at least `window` epochs unless capped first (cap 7 < window 10 here)
    assert len(start_losses) == 7 and len(later_losses) == 1
    strategy = make_strategy("fedala", digits_spec, train_cfg, {"max_start_epochs": 40, "loss_std": 10.0})
    _, settled = strategy.learn_weights(model, g, local, ones, digits_clients[0], ctx, start=True)
    assert len(settled) == 10  # a loose std threshold stops as soon as the window is full
