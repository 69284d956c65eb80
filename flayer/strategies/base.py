"""One protocol, two sides: what a client does in its local round, and how the server folds uploads.

A strategy is constructed from the model spec, the training config and its own option table. The
client side is two steps, with evaluation in between (PFLlib's protocol: accuracy after the
download, before local training):

    model  = strategy.receive(global_state, state, data, ctx)     # download: e.g. FLAYER's PLA
    ...evaluate model on the client's test split...
    result = strategy.local_round(model, global_state, state, data, ctx)   # train, mask, upload

``result.update`` is what travels (sparse deltas against ``global_state``) and ``result.state`` is
what the client keeps (explicit and serialisable, so a device can keep it on disk). The server side
is ``strategy.aggregator(global_state)``: a streaming accumulator whose ``result()`` is the next
global state. A transport (in-process, or MQTT) sits between the two sides; nothing here knows which.

Some strategies decide part of their configuration from the clients' data before round 1 (PLayer-FL's
split, FLAYER's ``head = auto``). That is a *calibration* phase ("round 0"), transport-neutral like the
rest: when ``needs_calibration()``, every client runs ``calibrate(global_state, data, ctx)`` on the
common initial model and reports a flat ``{name: float}`` mapping; the server folds all reports with
``resolve_calibration(reports, weights)`` into strategy *option* updates (plain JSON values), and the
federation then runs ``strategy.with_options(resolved)`` -- i.e. ``type(strategy)(spec, train,
{**options, **resolved})`` -- so the decision travels in the round plan as ordinary options.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..aggregate import DEFAULT_TRIM, Aggregator, RobustAggregator, make_aggregator
from ..config import TrainConfig, from_mapping
from ..models import ModelSpec, build_model
from ..train import ClientData
from ..update import Update

__all__ = ["ClientState", "LocalResult", "NoOptions", "RoundContext", "Strategy", "derive_seed"]


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any parts (run seed, round, client...), stable across machines."""
    h = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


@dataclass
class ClientState:
    """What a client keeps between rounds: named tensors (personal parts) and scalars.

    Strategies namespace their keys (e.g. ``personal.fc.weight``, ``acc_val``). Saved with
    :func:`flayer.state.save_client_state`.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, float | int | str] = field(default_factory=dict)

    def copy(self) -> ClientState:
        return ClientState({k: v.clone() for k, v in self.tensors.items()}, dict(self.scalars))

    def prefixed(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors stored under ``prefix`` (e.g. ``personal.``), with the prefix stripped."""
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class RoundContext:
    round: int  # 1-based federation round
    client: int  # the client's index in the partition
    seed: int  # the run seed
    device: torch.device = torch.device("cpu")

    def generator(self, purpose: str = "train") -> torch.Generator:
        """A CPU generator seeded from (seed, round, client, purpose): same draws on any machine."""
        return torch.Generator().manual_seed(derive_seed(self.seed, self.round, self.client, purpose))


@dataclass
class LocalResult:
    update: Update  # what is uploaded
    state: ClientState  # what the client keeps
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. train_loss, acc_val


@dataclass(frozen=True)
class NoOptions:
    """For strategies without options of their own."""


class Strategy(ABC):
    """Base class: subclasses set ``name`` and ``options_type`` and implement the client side."""

    name: ClassVar[str]
    options_type: ClassVar[type] = NoOptions

    def __init__(self, spec: ModelSpec, train: TrainConfig, options: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self.train = train
        self.options: Any = from_mapping(self.options_type, options or {}, f"[strategy.{self.name}]")

    # ---- shared helpers -------------------------------------------------------------------
    def new_model(self, device: torch.device | None = None) -> nn.Module:
        model = build_model(self.spec)
        return model.to(device) if device is not None else model

    def keep_blank(self) -> Strategy:
        """Keep one blank model for :meth:`model_from` to copy, for this strategy and those :meth:`with_options`
        makes from it. Only a process that runs many devices on one strategy asks for it (``flayer simulate``,
        the virtual fleet): an edge client keeps no model between rounds, so it holds none for it."""
        self._keep_blank = True
        return self

    def blank_model(self) -> tuple[nn.Module, frozenset[str]]:
        """A blank model and the names of its floating-point state: the one kept by :meth:`keep_blank` (built
        and initialised once; every float tensor of a copy is overwritten by the load, so a fresh model's random
        initialisation per call, most of the cost of a round's download at 1,000 simulated devices, bought
        nothing), else a new one."""
        blank = self.__dict__.get("_blank")
        if blank is None:
            model = self.new_model()
            blank = (model, frozenset(k for k, v in model.state_dict().items() if v.is_floating_point()))
            if self.__dict__.get("_keep_blank"):
                self._blank = blank
        return blank

    def model_from(self, state: Mapping[str, torch.Tensor], device: torch.device) -> nn.Module:
        """A model on ``device`` holding ``state`` (float tensors; integer buffers keep defaults), its own tensors:
        a copy of the kept blank model (training it changes neither) or a new model."""
        template, floats = self.blank_model()
        missing = floats - set(state)
        if missing:
            raise KeyError(f"state lacks tensors {sorted(missing)[:5]}")
        kept = self.__dict__.get("_blank")
        model = copy.deepcopy(template) if kept is not None and kept[0] is template else template
        unexpected = model.load_state_dict(dict(state), strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"state holds tensors the model does not have: {sorted(unexpected)[:5]}")
        return model.to(device)

    # ---- client side ------------------------------------------------------------------------
    def initial_state(self) -> ClientState:
        """The state of a client that has never participated."""
        return ClientState()

    def receive(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                ctx: RoundContext) -> nn.Module:
        """The download step: the model this client evaluates and starts training from.
        Default: the global model as is."""
        return self.model_from(global_state, ctx.device)

    @abstractmethod
    def local_round(self, model: nn.Module, global_state: Mapping[str, torch.Tensor], state: ClientState,
                    data: ClientData, ctx: RoundContext) -> LocalResult:
        """Train ``model`` (from :meth:`receive`) locally and build the upload and the kept state."""

    def personal_model(self, global_state: Mapping[str, torch.Tensor], state: ClientState, data: ClientData,
                       ctx: RoundContext) -> nn.Module:
        """The model this client would deploy after the federation ends. Default: :meth:`receive`
        of the final global model (FedBABU, e.g., fine-tunes here)."""
        return self.receive(global_state, state, data, ctx)

    # ---- calibration ("round 0", optional) ---------------------------------------------------
    def needs_calibration(self) -> bool:
        """True when this configuration must be calibrated on the clients' data before round 1."""
        return False

    def calibrate(self, global_state: Mapping[str, torch.Tensor], data: ClientData,
                  ctx: RoundContext) -> dict[str, float]:
        """Client side of the calibration: a flat report of finite floats (serialisable as JSON).
        ``global_state`` is the common initial model; ``ctx.round`` is 0."""
        raise NotImplementedError(f"strategy {self.name!r} has no calibration phase")

    def resolve_calibration(self, reports: Sequence[Mapping[str, float]],
                            weights: Sequence[float]) -> dict[str, Any]:
        """Server side of the calibration: fold the clients' reports (``weights``: their training
        sample counts) into option updates for :meth:`with_options`. Raises ValueError on bad reports."""
        return {}

    def options_dict(self) -> dict[str, Any]:
        """The current options as a plain mapping (what a round plan carries)."""
        opts = self.options
        return dataclasses.asdict(opts) if dataclasses.is_dataclass(opts) and not isinstance(opts, type) else {}

    def with_options(self, updates: Mapping[str, Any]) -> Strategy:
        """The same strategy with some options replaced (e.g. the calibration's decision)."""
        made = type(self)(self.spec, self.train, {**self.options_dict(), **dict(updates)})
        return made.keep_blank() if self.__dict__.get("_keep_blank") else made

    # ---- server side ------------------------------------------------------------------------
    def server_rule(self) -> str:
        """``carry``, ``zero``, ``median`` or ``trimmed`` (see :mod:`flayer.aggregate`)."""
        return "carry"

    def server_trim(self) -> float:
        """Rule ``trimmed``: the fraction of the deltas dropped at each end, per coordinate."""
        return DEFAULT_TRIM

    def aggregator(self, global_state: Mapping[str, torch.Tensor]) -> Aggregator | RobustAggregator:
        agg: Aggregator | RobustAggregator = make_aggregator(global_state, self.server_rule(), self.server_trim())
        return agg
