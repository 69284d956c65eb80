"""Canary devices in a small private federation, and what each adversary reads of it.

The federation is :func:`flayer.simulation.simulate` itself (the round engine the coordinator drives:
device-side clipping, the coordinator's re-clip, the fixed-denominator noised sum of
:class:`flayer.aggregate.DPSumAggregator`), over sklearn's digits (16x16 here) and a small MLP, so one run takes a
fraction of a second. A **canary device** takes part in every round like the others but does not train: it
uploads ``scale x u`` for a fixed unit direction ``u`` (``scale`` far above C, so the device clips it to
``C u``, the largest change one device can make), or, in the neighbouring world, a zero upload. The two
worlds differ by ``C u`` in each round's sum, exactly the sensitivity the accountant composes (one device
added or removed, the denominator fixed).

The adversaries (docs/explanation/privacy.md, "Who learns what"), each with only its view:

- ``models``: a reader of the published models. Its score is the projection of the last model's change on
  ``u``: ``<g_T - g_0, u>``, the sufficient statistic when every round adds ``C u`` under Gaussian noise.
- ``plans``: a device or broker observer, who also reads every round plan, and with it the run seed, the
  round, C, z and m. It regenerates the noise each round would carry were it drawn from what the plan
  carries (:func:`flayer.engine.round.noise_seed`, in :class:`~flayer.aggregate.DPSumAggregator`'s order),
  subtracts it, and keeps the result when that shrinks the change (the replay worked); otherwise it falls
  back on the models reader's score, so its view is never worse.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from flayer.config import TrainConfig
from flayer.engine.privacy import RoundPrivacy
from flayer.engine.round import noise_seed
from flayer.privacy_config import PrivacySettings
from flayer.spec import ModelSpec
from flayer.strategies.base import ClientState, LocalResult, RoundContext
from flayer.strategies.fedavg import FedAvg
from flayer.train import ClientData
from flayer.update import TensorDelta, Update

__all__ = [
    "ADVERSARIES",
    "AuditFederation",
    "CanaryFedAvg",
    "RunView",
    "adversary_vectors",
    "audit_mlp",
    "digits_clients",
    "flatten",
    "regenerated_noise",
    "run_federation",
    "scores",
]

log = logging.getLogger(__name__)

ADVERSARIES = {"models": "readers of the published models",
               "plans": "devices and broker observers (published models and round plans, run seed included)"}


def audit_mlp(in_features: int = 256, hidden: int = 32, num_classes: int = 10) -> nn.Module:
    """The audit federation's model: a one-hidden-layer MLP over the flattened 16x16 digits."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


AUDIT_SPEC = ModelSpec("flayer.audit.canary:audit_mlp", 1, 16, 16, 10)


def flatten(state: Mapping[str, torch.Tensor]) -> np.ndarray:
    """A model's float tensors, in its order, as one float64 vector (what a direction is over)."""
    return np.concatenate([v.detach().cpu().numpy().reshape(-1).astype(np.float64)
                           for v in state.values() if v.is_floating_point()])


class CanaryFedAvg(FedAvg):
    """FedAvg whose canary clients upload a fixed direction instead of training. ``canaries``: client index
    -> that client's unit direction over the flattened model, or None for a zero upload (the canary left
    out); ``scale``: the upload's norm before the device clips it."""

    name = "fedavg-canary"

    def __init__(self, spec: ModelSpec, train: TrainConfig, canaries: Mapping[int, np.ndarray | None],
                 scale: float) -> None:
        super().__init__(spec, train)
        self.canaries, self.scale = dict(canaries), scale

    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        if ctx.client not in self.canaries:
            return super().local_round(model, global_state, state, data, ctx)
        u = self.canaries[ctx.client]
        deltas: dict[str, TensorDelta] = {}
        at = 0
        for name, v in global_state.items():
            if not v.is_floating_point():
                continue
            n = v.numel()
            values = np.zeros(n) if u is None else self.scale * u[at:at + n]
            deltas[name] = TensorDelta(tuple(v.shape), values.astype(np.float32))
            at += n
        # a loss for the driver's round record (a private round sends none); it did not train
        return LocalResult(Update(deltas, max(1, data.num_train), {}), state, {"train_loss": 0.0})


def digits_clients(clients: int, seed: int = 0, samples: int = 600) -> list[ClientData]:
    """``clients`` shares of sklearn's digits (Dir(0.5) labels), the training devices of the federation."""
    from flayer.data import load_dataset
    from flayer.partition import make_partition
    from flayer.train import client_data

    digits = load_dataset("digits")
    part = make_partition(digits.y, 10, clients, "dir0.5", seed=seed, samples=samples)
    return [client_data(digits, c) for c in part.clients]


@dataclass(frozen=True)
class AuditFederation:
    """A small private federation: ``trainers`` devices that train, ``canaries`` that do not, every device in
    every round (the cohort is public: the accountant composes each round at q = 1), central noise."""

    trainers: int = 3
    canaries: int = 1
    rounds: int = 1
    noise_multiplier: float = 1.0
    clip: float = 1.0
    delta: float = 1e-5
    lr: float = 0.05
    canary_scale: float = 1e3  # far above C: the canary is clipped to exactly C u

    @property
    def population(self) -> int:
        return self.trainers + self.canaries

    def privacy(self) -> PrivacySettings:
        return PrivacySettings(enabled=True, mode="central", clip=self.clip, noise_multiplier=self.noise_multiplier,
                               delta=self.delta, population=self.population)

    def accountant_epsilon(self) -> float:
        """The accountant's epsilon for a device in every round (``flayer.engine.accountant.epsilon_for``)."""
        from flayer.engine.accountant import epsilon_for

        return epsilon_for([(self.noise_multiplier, 1.0, self.rounds)], self.delta)


@dataclass
class RunView:
    """What one run publishes, per adversary: the models (first and last; the rest telescope away for these
    statistics) and the plans' fields the replay reads (run seed, round, the round's privacy mapping)."""

    first: np.ndarray
    last: np.ndarray
    names: list[tuple[str, int]]  # (tensor, coordinates) in the model's order
    plans: list[dict[str, Any]] = field(default_factory=list)


def run_federation(fed: AuditFederation, datas: Sequence[ClientData], directions: Mapping[int, np.ndarray | None],
                   seed: int, global_state: Mapping[str, torch.Tensor], seeded_noise: bool = False) -> RunView:
    """One private run of ``fed`` through :func:`flayer.simulation.simulate`: trainers ``0..trainers-1`` on
    ``datas``, canary devices at the indices of ``directions`` (they evaluate on trainer 0's data; they never
    train). ``seeded_noise``: ``simulate``'s labelled not-private mode (noise from the run seed)."""
    from flayer.simulation import simulate

    train = TrainConfig(lr=fed.lr, batch_size=10, local_epochs=1, device="cpu", amp=False)
    strategy = CanaryFedAvg(AUDIT_SPEC, train, directions, fed.canary_scale)
    clients = list(datas[:fed.trainers]) + [datas[0]] * fed.canaries
    settings = fed.privacy()
    plans: list[dict[str, Any]] = []

    def on_round(rec: Any) -> None:  # what the round's plan carried (flayer.protocol.Plan: seed, round, privacy)
        rp = RoundPrivacy.of(settings.resolve(fed.population, fed.population), rec.clip)
        plans.append({"seed": seed, "round": rec.round, "selected": list(rec.selected), "privacy": rp.as_plan()})

    extra: dict[str, Any] = {"seeded_noise": True} if seeded_noise else {}
    result = simulate(strategy, clients, fed.rounds, seed, 1.0, global_state=global_state, on_round=on_round,
                      privacy=settings, **extra)
    if result.diverged is not None or len(result.rounds) != fed.rounds:
        raise RuntimeError(f"audit federation stopped early: {result.diverged or result.budget_stop}")
    names = [(k, v.numel()) for k, v in global_state.items() if v.is_floating_point()]
    return RunView(flatten(global_state), flatten(result.global_state), names, plans)


def regenerated_noise(plan: Mapping[str, Any], names: Sequence[tuple[str, int]]) -> np.ndarray:
    """The plan reader's guess of a round's noise on the sum: drawn from (run seed, round) as
    :func:`flayer.engine.round.noise_seed` derives it, in the aggregator's order (the adaptive clip-bit
    draw first, then each tensor's coordinates; every coordinate is sent in these dense rounds)."""
    rp = RoundPrivacy.from_plan(plan["privacy"])
    assert rp is not None
    rng = np.random.default_rng(noise_seed(int(plan["seed"]), int(plan["round"])))
    if rp.adaptive:
        rng.normal(0.0, rp.bit_std)
    return np.concatenate([rng.normal(0.0, rp.sum_std, n) for _, n in names])


def adversary_vectors(view: RunView) -> dict[str, np.ndarray]:
    """The vector each adversary projects directions on, for one run (module docstring): the models reader's
    ``g_T - g_0``; the plan reader's ``g_T - g_0`` less the noise it regenerated over m, when that removed
    noise rather than adding more (else the same as the models reader's)."""
    change = view.last - view.first
    rp = RoundPrivacy.from_plan(view.plans[0]["privacy"])
    assert rp is not None
    replayed = change - sum(regenerated_noise(p, view.names) for p in view.plans) / rp.contributions
    worked = float(replayed @ replayed) < 0.5 * float(change @ change)
    log.debug("plan reader: replay %s", "worked" if worked else "failed")
    return {"models": change, "plans": replayed if worked else change}


def scores(view: RunView, directions: np.ndarray) -> dict[str, np.ndarray]:
    """Each adversary's score of each direction (rows of ``directions``) for one run: its vector's projection."""
    return {adv: directions @ v for adv, v in adversary_vectors(view).items()}


def random_directions(count: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` independent directions uniform on the unit sphere of R^dim (rows)."""
    g = rng.normal(size=(count, dim))
    return g / np.linalg.norm(g, axis=1, keepdims=True)


def model_dim(state: Mapping[str, torch.Tensor]) -> int:
    return int(sum(v.numel() for v in state.values() if v.is_floating_point()))


def initial_state(seed: int) -> dict[str, torch.Tensor]:
    """The audit federation's first global model (the engine's initialisation, from ``seed``)."""
    from flayer.engine.round import initial_global_state

    return initial_global_state(CanaryFedAvg(AUDIT_SPEC, TrainConfig(device="cpu"), {}, 1.0), seed)


def unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 and math.isfinite(n) else v
