"""The federation's progress: what the coordinator has made of its rounds so far.

:class:`Progress` is owned by :class:`coordinator.cycle.RoundCycle`, the only part that writes it (a round's
close, the start-up from a checkpoint, a calibration's result); the parts that publish (the plan,
:class:`coordinator.publishing.Publishing`) and take updates (:class:`coordinator.messages_in.MessageIntake`)
read it. docs/explanation/design.md, "The coordinator's parts".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from flayer.engine import expected_close
from flayer.strategies.base import Strategy

from .config import CoordinatorConfig, FederationSettings
from .privacy import FederationPrivacy
from .publish import ModelBlob

__all__ = ["Progress", "identity"]


@dataclass
class Progress:
    """The global model and what the closed rounds decided."""

    strategy: Strategy
    options: dict[str, Any]  # in force: the config's, plus what a calibration resolved (or public positions)
    done_round: int = 0
    global_state: dict[str, torch.Tensor] = field(default_factory=dict)
    model: ModelBlob | None = None  # the global model's blob (None until the start-up made one)
    accepted_before: dict[int, set[str]] = field(default_factory=dict)  # recent closed rounds (duplicates vs late)
    history: list[dict[str, Any]] = field(default_factory=list)  # the closed rounds' records
    durations: list[float] = field(default_factory=list)  # the last rounds' lengths: the plan's close_by

    def current_model(self) -> ModelBlob:
        if self.model is None:
            raise RuntimeError("the global model is made at the start-up (coordinator.cycle.RoundCycle.restore)")
        return self.model

    def close_by(self, fs: FederationSettings, opened_at: float, deadline: float, last: bool) -> float:
        """The plan's ``close_by``: :func:`flayer.engine.versions.expected_close` (0: no history yet); ``last``:
        the run's last round."""
        close = expected_close(fs.mode, opened_at, deadline, self.durations, fs.staleness_bound, last)
        return 0.0 if close is None else close


def identity(cfg: CoordinatorConfig, privacy: FederationPrivacy | None, asynchronous: bool,
             federation: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed (coordinator.checkpoint)."""
    ident = {"federation": federation, "strategy": cfg.run.strategy, "seed": cfg.run.seed,
             "options": dict(cfg.options), "train": cfg.train_plan, "model": dataclasses.asdict(cfg.spec)}
    if privacy is not None:  # a private run resumes only as the same private run
        ident["privacy"] = dataclasses.asdict(privacy.settings)
    return {**ident, "mode": "async"} if asynchronous else ident
