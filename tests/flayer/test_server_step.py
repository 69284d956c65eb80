"""The server step of private rounds (flayer.engine.server_step, docs/explanation/privacy.md): its arithmetic, the
refusals of bad settings, its saved state, and the simulator applying it as post-processing (the same epsilon, the
model ``prev + eta * v``); ``--clip-only``, the measurement of the clip without noise."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch

from cli.main import main
from flayer.config import TrainConfig
from flayer.engine import initial_global_state
from flayer.engine.server_step import ServerStep
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings, auto_server_lr
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data

TRAIN = TrainConfig(lr=0.05, batch_size=10, device="cpu")
COMMON = ["--dataset", "digits", "--clients", "10", "--rounds", "2", "--seed", "1", "--threads", "1",
          "--samples", "300", "--join-ratio", "0.5", "--strategy", "fedavg"]


def test_the_step_is_heavy_ball_momentum_on_the_published_move():
    step = ServerStep(2.0, 0.5)
    g0 = {"w": torch.zeros(3), "n": torch.tensor([7])}
    g1 = step.apply(g0, {"w": torch.tensor([1.0, -1.0, 0.5]), "n": torch.tensor([8])})
    assert torch.allclose(g1["w"], torch.tensor([2.0, -2.0, 1.0]))  # v = d, next = prev + 2 d
    assert int(g1["n"]) == 8  # integer tensors are taken as published
    g2 = step.apply(g1, {"w": g1["w"] + torch.tensor([1.0, 1.0, 1.0]), "n": torch.tensor([8])})
    # v = 0.5 * [1, -1, 0.5] + [1, 1, 1] = [1.5, 0.5, 1.25]; next = g1 + 2 v
    assert torch.allclose(g2["w"], g1["w"] + 2 * torch.tensor([1.5, 0.5, 1.25]))
    plain = ServerStep()
    new = {"w": torch.ones(3)}
    assert plain.plain and plain.apply(g0, new)["w"] is new["w"] and plain.velocity == {}


@pytest.mark.parametrize("lr, momentum, needle", [
    (0.0, 0.0, "server_lr"), (-1.0, 0.0, "server_lr"), (math.nan, 0.0, "server_lr"), (math.inf, 0.0, "server_lr"),
    (101.0, 0.0, "server_lr"), (True, 0.0, "server_lr"), ("2", 0.0, "server_lr"),
    (1.0, 1.0, "server_momentum"), (1.0, -0.1, "server_momentum"), (1.0, math.nan, "server_momentum"),
])
def test_bad_settings_are_refused_naming_the_key(lr, momentum, needle):
    with pytest.raises(ValueError, match=needle):
        ServerStep(lr, momentum)
    with pytest.raises(ValueError, match=needle):
        PrivacySettings(enabled=True, server_lr=lr, server_momentum=momentum)


@pytest.mark.parametrize("z, clip, m, eta", [
    (1.0401, 0.3, 20, 1.39),  # 100 devices, epsilon 8 under a schema of 3: z C / m = 0.016
    (1.8985, 0.3, 20, 1.03),  # epsilon 8 every round: 0.028, about the plain step
    (3.4551, 0.3, 20, 1.0),  # epsilon 2 under the schema: 0.052, more noise than the reference: the floor
    (1.3428, 0.3, 200, 3.0),  # 1,000 devices: 0.002, the ceiling
    (0.0, 0.3, 20, 3.0),  # no noise: the longest step
])
def test_auto_sizes_the_step_by_the_noise_on_the_average(z, clip, m, eta):
    assert auto_server_lr(z, clip, m) == eta
    settings = PrivacySettings(enabled=True, clip=clip, noise_multiplier=z)
    assert settings.server_lr == "auto"  # the default, resolved with the federation's m
    resolved = settings.resolve(10 * m, m)
    assert resolved.server_lr == eta and ServerStep(resolved.server_lr).lr == eta
    assert PrivacySettings(enabled=True, noise_multiplier=z, server_lr=2.5).resolve(10 * m, m).server_lr == 2.5
    with pytest.raises(ValueError, match="server_lr"):  # the step itself takes only a number
        ServerStep("auto")  # type: ignore[arg-type]


def test_the_simulator_runs_the_resolved_auto_step(digits, clients):
    """A private run with the default step takes auto_server_lr(z, C, m) and records it; clip-only runs, with no
    noise to size the step by, take the plain one."""
    dp = PrivacySettings(enabled=True, clip=0.5, noise_multiplier=0.1)
    res = simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 1, seed=1, join_ratio=0.5,
                   privacy=dp, seeded_noise=True)
    assert res.server_step == (auto_server_lr(0.1, 0.5, 5), 0.0) == (1.73, 0.0)  # 10 clients, 5 a round: m = 5
    clip = simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 1, seed=1, join_ratio=0.5,
                    privacy=PrivacySettings(), clip_only=(0.5, "fixed"))
    assert clip.server_step == (1.0, 0.0)


def test_the_velocity_survives_a_restart_and_a_bad_saved_one_is_refused():
    step = ServerStep(1.5, 0.9)
    step.apply({"w": torch.zeros(2, 2)}, {"w": torch.full((2, 2), 0.25)})
    again = ServerStep(1.5, 0.9)
    again.load(step.state())
    assert np.array_equal(again.velocity["w"], step.velocity["w"]) and again.velocity["w"].shape == (2, 2)
    other = ServerStep(1.5, 0.5)  # another step: the saved velocity is not its own, it starts afresh
    other.load(step.state())
    assert other.velocity == {}
    state = step.state()
    state["velocity"]["w"]["values"] = "not base64!"
    with pytest.raises(ValueError, match="malformed"):
        again.load(state)
    state = step.state()
    state["velocity"]["w"]["values"] = base64.b64encode(np.array([np.inf, 0, 0, 0], dtype="<f4").tobytes()).decode()
    with pytest.raises(ValueError, match="non-finite"):
        again.load(state)


@pytest.fixture(scope="module")
def clients(digits):
    part = make_partition(digits.y, 10, 10, "dir0.5", seed=3, samples=400)
    return [client_data(digits, c) for c in part.clients]


def test_the_simulator_takes_the_step_as_post_processing(digits, clients):
    """Same seeded noise, one round: with eta = 2 the model moves twice as far as without, and every round's
    epsilon is the plain run's (the accountant composes the noised sums; the step spends nothing)."""
    def run(rounds: int, **step: float):
        dp = PrivacySettings(enabled=True, clip=0.5, noise_multiplier=1.0, **step)
        return simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, rounds, seed=1, join_ratio=0.5,
                        privacy=dp, seeded_noise=True)

    start = initial_global_state(make_strategy("fedavg", digits.model_spec(), TRAIN), 1)
    plain, stepped = run(1, server_lr=1.0), run(1, server_lr=2.0)
    for k, v in start.items():
        if v.is_floating_point():
            assert torch.allclose(stepped.global_state[k] - v, 2 * (plain.global_state[k] - v), atol=1e-6)
    a, b = run(3, server_lr=1.0), run(3, server_lr=2.0, server_momentum=0.5)
    assert [r.epsilon for r in a.rounds] == [r.epsilon for r in b.rounds] and a.epsilon == b.epsilon
    assert not all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)


def test_clip_only_measures_the_clip_without_noise_or_epsilon(digits, clients):
    def run(average: str):
        return simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 1, seed=1, join_ratio=0.5,
                        privacy=PrivacySettings(), clip_only=(0.05, average))

    fixed, again, weighted = run("fixed"), run("fixed"), run("weighted")
    assert fixed.epsilon is None and fixed.rounds[0].epsilon is None  # not private: no epsilon at all
    assert all(torch.equal(fixed.global_state[k], again.global_state[k]) for k in fixed.global_state)  # no noise
    assert not all(torch.equal(fixed.global_state[k], weighted.global_state[k]) for k in fixed.global_state)
    with pytest.raises(ValueError, match="clip_only"):
        simulate(make_strategy("fedavg", digits.model_spec(), TRAIN), clients, 1, seed=1, join_ratio=0.5,
                 privacy=PrivacySettings(enabled=True), clip_only=(0.05, "fixed"))


def test_the_cli_prints_the_same_epsilon_with_the_step(tmp_path, capsys):
    eps = []
    for flags in ([], ["--dp-server-lr", "3", "--dp-server-momentum", "0.9"]):
        assert main(["simulate", *COMMON, "--dp", "central", "--dp-noise", "2.0", *flags,
                     "--out", str(tmp_path / str(len(flags)))]) == 0
        out = capsys.readouterr().out
        eps.append([line for line in out.splitlines() if line.startswith("privacy: epsilon")])
    assert eps[0] and eps[0] == eps[1]


@pytest.mark.parametrize("flags, needle", [
    (["--dp", "central", "--dp-server-lr", "fast"], "[privacy].server_lr: expected float or 'auto', got 'fast'"),
    (["--dp", "central", "--dp-server-lr", "0"], "server_lr must be \"auto\" or a finite number in [0.001, 100]"),
    (["--dp", "central", "--dp-server-momentum", "1"], "server_momentum must be a finite number in [0, 1)"),
    (["--dp", "central", "--clip-only", "0.3"], "--clip-only 0.3"),
    (["--clip-only", "0"], "--clip-only 0.0"),
])
def test_the_cli_refuses_bad_steps_in_one_line(tmp_path, capsys, flags, needle):
    assert main(["simulate", *COMMON, *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
