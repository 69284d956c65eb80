"""One file per method; ``STRATEGIES`` maps the command-line names to their classes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import TrainConfig
from ..models import ModelSpec
from .base import ClientState, LocalResult, RoundContext, Strategy
from .ditto import Ditto
from .fedala import FedALA
from .fedavg import FedAvg
from .fedbabu import FedBABU
from .fedper import FedPer
from .fedrep import FedRep
from .flayer import Flayer, FlayerRef
from .lgfedavg import LGFedAvg
from .local import Local
from .playerfl import PLayerFL

__all__ = ["STRATEGIES", "ClientState", "LocalResult", "RoundContext", "Strategy", "make_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (FedAvg, Local, FedPer, FedRep, LGFedAvg, Ditto, FedALA, FedBABU, PLayerFL, Flayer, FlayerRef)
}


def make_strategy(name: str, spec: ModelSpec, train: TrainConfig,
                  options: Mapping[str, Any] | None = None) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy {name!r} is not available; available: {', '.join(sorted(STRATEGIES))}") from None
    return cls(spec, train, options)
