"""What :meth:`coordinator.server.Coordinator.run` returns, and the error it raises when it cannot run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CoordinatorError", "CoordinatorResult"]


class CoordinatorError(RuntimeError):
    """The coordinator cannot run (refused by the broker, unusable state folder, ...)."""


@dataclass
class CoordinatorResult:
    rounds_done: int
    global_state: dict[str, torch.Tensor]
    model_digest: str
    history: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    finished: bool = False  # every round ran
    stopped: bool = False  # stop() ended it early
