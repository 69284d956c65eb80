"""The FLAYER strategy end to end on tiny data: PLA and the head-only epoch in ``receive``, masked
uploads and kept state in ``local_round``, the two presets, options validation."""

from __future__ import annotations

import math

import pytest
import torch

from flayer.config import ConfigError, TrainConfig
from flayer.partition import make_partition
from flayer.engine import initial_global_state
from flayer.state import load_client_state, save_client_state
from flayer.strategies import make_strategy
from flayer.strategies.base import ClientState, RoundContext
from flayer.train import client_data

TRAIN = TrainConfig(lr=0.05, batch_size=10, local_epochs=1, device="cpu")


@pytest.fixture(scope="module")
def clients(digits):
    part = make_partition(digits.y, 10, 4, "dir0.5", seed=1)
    return [client_data(digits, c) for c in part.clients]


def _ctx(round_=1, client=0):
    return RoundContext(round=round_, client=client, seed=0)


def test_first_round_receive_is_global_body_and_head_epoch_touches_only_the_head(digits, clients):
    s = make_strategy("flayer", digits.model_spec(), TRAIN)
    g = initial_global_state(s, 0)
    model = s.receive(g, s.initial_state(), clients[0], _ctx())
    state = model.state_dict()
    for name in g:
        same = torch.equal(state[name], g[name])
        assert same == (name not in s.head_params), name  # head trained one epoch, body untouched
    no_epoch = make_strategy("flayer", digits.model_spec(), TRAIN, {"head_epoch": False})
    plain = no_epoch.receive(g, no_epoch.initial_state(), clients[0], _ctx()).state_dict()
    assert all(torch.equal(plain[n], g[n]) for n in g)  # A_l = 0 the first time: the global model


def test_pla_uses_kept_head_and_validation_accuracy(digits, clients):
    s = make_strategy("flayer", digits.model_spec(), TRAIN, {"head_epoch": False})
    g = initial_global_state(s, 0)
    local_head = {n: torch.full_like(g[n], 0.5) for n in s.head}
    state = ClientState({f"personal.{n}": v for n, v in local_head.items()}, {"acc_val": 0.25})
    got = s.receive(g, state, clients[0], _ctx(2)).state_dict()
    for n in s.head:
        assert torch.allclose(got[n], 0.25 * local_head[n] + 0.75 * g[n])
    for bad in ("0.3", 1.5):  # a state file from a device is input from outside: checked
        with pytest.raises(ValueError, match="acc_val|A_l"):
            s.receive(g, ClientState(state.tensors, {"acc_val": bad}), clients[0], _ctx(2))
    off = make_strategy("flayer", digits.model_spec(), TRAIN, {"head_epoch": False, "pla": False})
    got = off.receive(g, state, clients[0], _ctx(2)).state_dict()
    assert all(torch.equal(got[n], g[n]) for n in s.head)


def test_local_round_masks_state_and_metrics(digits, clients, tmp_path):
    s = make_strategy("flayer", digits.model_spec(), TRAIN)
    g = initial_global_state(s, 0)
    data = clients[1]
    model = s.receive(g, s.initial_state(), data, _ctx())
    res = s.local_round(model, g, s.initial_state(), data, _ctx())
    up = res.update
    assert up.num_samples == data.num_train
    # per layer i of 4, exactly ceil(i/4 * n_i) entries are sent; the head whole
    for layer in s.plan.layers:
        n = sum(g[p].numel() for p in layer.params)
        sent = sum(up.deltas[p].count for p in layer.params)
        assert sent == math.ceil(min(max(layer.index / 4, 0.1), 1.0) * n)
    assert up.deltas["fc.weight"].indices is None
    acc = res.state.scalars["acc_val"]
    correct = int((model(data.val.prepare(data.val.x, torch.device("cpu"))).argmax(1) == data.val.y).sum())
    assert acc == pytest.approx(correct / len(data.val))  # A_l: validation accuracy after training
    assert set(res.state.tensors) == {"personal.fc.weight", "personal.fc.bias"}
    assert torch.equal(res.state.tensors["personal.fc.weight"], model.fc.weight.detach())
    # the kept state survives a round trip through the on-disk format
    save_client_state(tmp_path / "c.safetensors", res.state)
    back, _ = load_client_state(tmp_path / "c.safetensors")
    assert back.scalars == res.state.scalars
    assert all(torch.equal(back.tensors[k], v) for k, v in res.state.tensors.items())


def test_no_masks_uploads_everything(digits, clients):
    s = make_strategy("flayer", digits.model_spec(), TRAIN, {"masks": False, "lr_rule": False})
    g = initial_global_state(s, 0)
    model = s.receive(g, s.initial_state(), clients[0], _ctx())
    up = s.local_round(model, g, s.initial_state(), clients[0], _ctx()).update
    assert up.sent == up.numel == sum(v.numel() for v in g.values())


def test_flayer_ref_preset(digits, clients):
    s = make_strategy("flayer-ref", digits.model_spec(), TRAIN)
    assert s.head == ("fc.weight", "fc.bias") and s.server_rule() == "carry"
    rule = s._lr_rule()
    got = (rule.kind, rule.every, rule.ref_num_layers, rule.ref_scale, rule.cap)
    assert got == ("ref", "epoch", 3, 20.0, None)
    g = initial_global_state(s, 0)
    data = clients[2]
    model = s.receive(g, s.initial_state(), data, _ctx())
    correct = int((model(data.val.prepare(data.val.x, torch.device("cpu"))).argmax(1) == data.val.y).sum())
    res = s.local_round(model, g, s.initial_state(), data, _ctx())
    # A_l measured on the received model, before training
    assert res.state.scalars["acc_val"] == pytest.approx(correct / len(data.val))
    d = res.update.deltas
    assert d["fc1.0.weight"].indices is None and d["fc.weight"].indices is None
    assert d["conv1.0.weight"].indices is not None
    # conv1.0.weight is tensor 0 of 8: keep 0.1 -> every 5x5 kernel drops round(25 * 0.9) = 22 (half to
    # even), keeping 3
    assert d["conv1.0.weight"].count == 32 * 3


def test_same_round_same_result(digits, clients):
    s = make_strategy("flayer", digits.model_spec(), TRAIN)
    g = initial_global_state(s, 0)
    outs = []
    for _ in range(2):
        model = s.receive(g, s.initial_state(), clients[0], _ctx())
        outs.append(s.local_round(model, g, s.initial_state(), clients[0], _ctx()).update)
    for name, d in outs[0].deltas.items():
        assert (d.values == outs[1].deltas[name].values).all()


@pytest.mark.parametrize("opts, message", [
    ({"mask_floor": 0.0}, "mask_floor"),
    ({"lr_cap": 0.5}, "lr_cap"),
    ({"server_rule": "mean"}, "server_rule"),
    ({"lr_every": "batch"}, "lr_every"),
    ({"masks": "yes"}, "masks"),
    ({"head_layers": 9}, "head_layers"),
    ({"unknown": 1}, "unknown"),
])
def test_bad_options_are_named(digits, opts, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        make_strategy("flayer", digits.model_spec(), TRAIN, opts)


def test_zero_rule_option_reaches_the_aggregator(digits):
    s = make_strategy("flayer", digits.model_spec(), TRAIN, {"server_rule": "zero"})
    assert s.aggregator(initial_global_state(s, 0)).rule == "zero"
