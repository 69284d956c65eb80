"""The device's ``runtime``: where a strategy's local SGD runs.

``torch`` (the default) trains in torch. ``executorch`` runs every SGD epoch of the strategy through
the model's ExecuTorch training program (:class:`export.et_engine.ExecuTorchEngine`, exported once
per model); the device then needs the ``executorch`` extra, which is checked when the device starts.
"""

from __future__ import annotations

from typing import Any

from flayer.strategies.base import Strategy
from flayer.train import TrainingEngine

from .work import EdgeError

__all__ = ["TrainingRuntime"]


class TrainingRuntime:
    def __init__(self, name: str, device_id: str) -> None:
        self.name, self.device_id = name, device_id
        self.engines: dict[Any, TrainingEngine] = {}  # ModelSpec -> ExecuTorchEngine
        if name == "executorch":
            from export.deps import MissingDependency, require_executorch

            try:
                require_executorch()
            except MissingDependency as exc:
                raise EdgeError(f"runtime executorch: {exc}") from exc

    def engine_for(self, strategy: Strategy) -> TrainingEngine | None:
        """The engine the strategy's SGD runs on (None: torch); EdgeError when the strategy or its
        model cannot train through the ExecuTorch program."""
        if self.name != "executorch":
            return None
        from export.et_engine import ExecuTorchEngine, UnsupportedTraining, check_strategy

        try:
            check_strategy(strategy.name, strategy.spec)
            if strategy.spec not in self.engines:
                self.engines[strategy.spec] = ExecuTorchEngine(strategy.spec)
        except UnsupportedTraining as exc:
            raise EdgeError(f"{self.device_id}: {exc}") from exc
        return self.engines[strategy.spec]
