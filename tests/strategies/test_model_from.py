"""Strategy.model_from copies a template built once: each copy holds exactly the state it was given, its own
tensors, and the template's integer buffers at their defaults however a earlier copy was trained."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flayer.config import TrainConfig
from flayer.models import ModelSpec
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy
from flayer.update import float_state

CPU = torch.device("cpu")


def _states(strategy: Strategy, *seeds: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in seeds:
        torch.manual_seed(seed)
        out.append({k: v.clone() for k, v in float_state(strategy.new_model()).items()})
    return out


@pytest.fixture
def resnet() -> Strategy:  # BatchNorm: running statistics (float) and num_batches_tracked (an integer buffer)
    return make_strategy("fedavg", ModelSpec("resnet18", 3, 32, 32, 10), TrainConfig()).keep_blank()


def test_model_from_holds_the_state_and_default_integer_buffers(resnet):
    (state,) = _states(resnet, 1)
    model = resnet.model_from(state, CPU)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    ints = {k: v for k, v in got.items() if not v.is_floating_point()}
    assert ints and all(int(v) == 0 for v in ints.values())


def test_a_trained_copy_changes_neither_the_next_copy_nor_the_state(resnet):
    first, second = _states(resnet, 1, 2)
    kept = {k: v.clone() for k, v in first.items()}
    a = resnet.model_from(first, CPU)
    a.train()
    opt = torch.optim.SGD(a.parameters(), lr=0.5)
    for _ in range(2):  # moves the parameters, the running statistics and num_batches_tracked of copy a
        opt.zero_grad()
        F.cross_entropy(a(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
    assert any(int(v) == 2 for k, v in a.state_dict().items() if k.endswith("num_batches_tracked"))
    assert all(torch.equal(first[k], kept[k]) for k in first)  # the caller's state is not the copy's storage
    b = resnet.model_from(second, CPU)
    assert b is not a
    got = b.state_dict()
    assert all(torch.equal(got[k], v) for k, v in second.items())
    assert all(int(v) == 0 for k, v in got.items() if k.endswith("num_batches_tracked"))
    c = resnet.model_from(first, CPU)  # a's training left nothing behind in the template
    assert all(torch.equal(c.state_dict()[k], v) for k, v in kept.items())


def test_the_template_is_built_once(monkeypatch):
    strategy = make_strategy("flayer", ModelSpec("cnn", 1, 28, 28, 10), TrainConfig()).keep_blank()
    (state,) = _states(strategy, 3)
    built = []
    new_model = strategy.new_model
    monkeypatch.setattr(strategy, "new_model", lambda device=None: built.append(1) or new_model(device))
    models = [strategy.model_from(state, CPU) for _ in range(3)]
    assert len(built) == 1
    assert len({id(p) for m in models for p in m.parameters()}) == 3 * len(list(models[0].parameters()))


def test_model_from_refuses_missing_and_unknown_tensors(resnet):
    (state,) = _states(resnet, 1)
    with pytest.raises(KeyError, match="state lacks tensors"):
        resnet.model_from({k: v for k, v in state.items() if k != "fc.weight"}, CPU)
    with pytest.raises(KeyError, match="does not have"):
        resnet.model_from({**state, "extra.weight": torch.zeros(1)}, CPU)


def test_only_a_strategy_asked_to_keeps_a_model_and_its_options_keep_asking():
    """An edge client's strategy keeps no model between rounds (an emulated fleet's idle devices hold none):
    only ``keep_blank`` (simulate, the virtual fleet) keeps one, also across ``with_options``."""
    plain = make_strategy("flayer", ModelSpec("cnn", 1, 28, 28, 10), TrainConfig())
    (state,) = _states(plain, 4)
    plain.model_from(state, CPU)
    assert "_blank" not in vars(plain) and not any(isinstance(v, torch.nn.Module) for v in vars(plain).values())
    kept = make_strategy("flayer", ModelSpec("cnn", 1, 28, 28, 10), TrainConfig()).keep_blank()
    made = kept.with_options({"positions": "public"})
    made.model_from(state, CPU)
    assert isinstance(vars(made).get("_blank"), tuple)
