"""The open round: the strategy's streaming aggregator, what has been folded into it, and the round
record both drivers write.

:class:`OpenAggregate` is the one path an admitted update takes into a global model, for the
in-process simulator and the MQTT coordinator alike (the coordinator journals before it folds).
:class:`RoundTally` counts what the folded updates add up to (coordinates sent, the evaluation the
clients reported before training, their training losses, clipped, capped and stale updates);
:class:`RoundRecord` is the round as ``flayer simulate`` reports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flayer.aggregate import DPSumAggregator
from flayer.strategies.base import Strategy, derive_seed
from flayer.update import Update, float_state

from .gate import Verdict
from .privacy import UNCLIPPED_KEY, RoundPrivacy

__all__ = ["OpenAggregate", "RoundRecord", "RoundTally", "initial_global_state", "noise_seed"]


def noise_seed(seed: int, round_: int) -> int:  # --dp-seeded-noise only: protects nothing
    """The seed of round ``round_``'s noise in ``flayer simulate --dp-seeded-noise`` only (reproducible runs,
    labelled not private). Nothing that publishes a model uses it: the run seed travels in every plan, so
    noise drawn from it can be regenerated and subtracted by any device or observer."""
    return derive_seed(seed, round_, "dp-central-noise")


def initial_global_state(strategy: Strategy, seed: int) -> dict[str, torch.Tensor]:
    """The round-1 global model: the strategy's model initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):  # leaves the caller's global RNG state as it was
        torch.manual_seed(derive_seed(seed, "init"))
        return float_state(strategy.new_model())


@dataclass
class RoundTally:
    """What the updates folded into one round (or one asynchronous buffer) add up to."""

    accepted: int = 0
    sent: int = 0  # coordinates uploaded
    numel: int = 0  # coordinates dense uploads of the same tensors would hold
    indexed: int = 0  # explicit positions uploaded (sparse deltas)
    clipped: int = 0
    weight_capped: int = 0
    # the clients' test evaluations before training and their training losses, as they reported them; summed
    # exactly rounded (math.fsum) when read, so the record is the same whatever order the updates arrived in
    correct: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    device_acc: dict[str, float] = field(default_factory=dict)

    def add(self, verdict: Verdict, client: str | None = None) -> None:
        up = verdict.update
        assert up is not None
        self.accepted += 1
        self.sent += up.sent
        self.numel += up.numel
        self.indexed += sum(d.count for d in up.deltas.values() if d.indices is not None)
        self.clipped += int(verdict.clipped)
        self.weight_capped += int(verdict.weight < up.num_samples)
        self.staleness.append(verdict.staleness)
        self.add_eval(up.info, client)

    def add_eval(self, info: Mapping[str, float], client: str | None = None) -> None:
        """Fold a client's reported evaluation (``test_correct``, ``test_total``, ``train_loss``)."""
        c, t = info.get("test_correct"), info.get("test_total")
        if c is not None and t is not None and t > 0 and 0 <= c <= t:
            self.correct.append(float(c))
            self.total.append(float(t))
            if client is not None:
                self.device_acc[client] = float(c) / float(t)
        loss = info.get("train_loss")
        if loss is not None and math.isfinite(loss):
            self.losses.append(float(loss))

    def add_sum(self, total: Update, count: int) -> None:
        """A secure round's unmasked sum of ``count`` uploads, each at ``total``'s positions."""
        self.accepted += count
        self.sent += total.sent * count
        self.numel += total.numel * count
        self.indexed += count * sum(d.count for d in total.deltas.values() if d.indices is not None)

    def remove(self, n: int) -> None:
        """``n`` folded updates were taken out again (quarantined)."""
        self.accepted -= n

    @property
    def acc(self) -> float | None:
        total = math.fsum(self.total)
        return math.fsum(self.correct) / total if total else None

    @property
    def train_loss(self) -> float | None:
        return math.fsum(self.losses) / len(self.losses) if self.losses else None

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0


class OpenAggregate:
    """A round's (or buffer's) aggregator over ``global_state`` and its tally. ``privacy``: a private round,
    folded by :class:`flayer.aggregate.DPSumAggregator` with its noise from the operating system's CSPRNG
    (``seed`` None) or, for ``flayer simulate --dp-seeded-noise`` alone, from ``seed`` (:func:`noise_seed`)."""

    def __init__(self, strategy: Strategy, global_state: Mapping[str, torch.Tensor],
                 privacy: RoundPrivacy | None = None, seed: int | None = None) -> None:
        self.privacy = privacy
        if privacy is None:
            self.fresh: Callable[[], Any] = lambda: strategy.aggregator(global_state)
        else:
            std = privacy.sum_std if privacy.mode == "central" else 0.0
            self.fresh = lambda: DPSumAggregator(global_state, privacy.contributions, std, seed, privacy.bit_std,
                                                 UNCLIPPED_KEY)
        self.aggregator = self.fresh()
        self._global, self._seed = global_state, seed
        self.shapes: Mapping[str, tuple[int, ...]] = self.aggregator.shapes
        self.tally = RoundTally()
        self.coordinates = sum(v.numel() for v in global_state.values())

    def fold(self, verdict: Verdict, client: str | None = None) -> None:
        """Fold an admitted update (:func:`flayer.engine.gate.admit`)."""
        assert verdict.accepted and verdict.update is not None
        self.aggregator.fold(verdict.update, weight=verdict.weight)
        self.tally.add(verdict, client)

    def fold_sum(self, total: Update, count: int, bits: float = 0.0, noised: bool = False) -> None:
        """Fold a secure round's unmasked sum of ``count`` uploads: into the private round's fixed-denominator
        sum, or (no DP) as their unweighted mean over the ``count`` survivors; ``noised``: it carries the
        central noise already (:attr:`flayer.engine.secure.SecureSum.noised`)."""
        if self.privacy is None:
            self.aggregator = DPSumAggregator(self._global, count, 0.0, self._seed)
        assert isinstance(self.aggregator, DPSumAggregator)
        self.aggregator.fold_sum(total, count, bits, noised)
        self.tally.add_sum(total, count)

    def withhold(self) -> int:
        """Fold nothing of this round after all (a private round whose sum may not be published): a fresh
        aggregator, so the result is the previous model; the number of updates that were folded."""
        folded = self.tally.accepted
        self.aggregator = self.fresh()
        self.tally.remove(folded)
        return folded

    def unsent(self) -> int:
        return self.aggregator.unsent() if self.aggregator.contributors else 0

    def result(self) -> dict[str, torch.Tensor]:
        return self.aggregator.result()

    def noised_bits(self) -> float:
        """Adaptive clipping: the noised count of unclipped uploads (:class:`flayer.aggregate.DPSumAggregator`)."""
        assert isinstance(self.aggregator, DPSumAggregator), "not a private round"
        return self.aggregator.noised_bits()


@dataclass(frozen=True)
class RoundRecord:
    round: int
    acc: float  # sample-weighted test accuracy over all clients, after download, before training
    loss: float
    train_loss: float  # mean over selected clients
    selected: tuple[int, ...]
    sent: int  # coordinates uploaded, all selected clients together
    numel: int  # coordinates a dense upload of the same tensors would hold
    upload_bytes: int  # wire bytes (0 when no sizer was given)
    seconds: float
    client_acc: tuple[float, ...]
    unsent: int = 0  # coordinates of the global model no selected client sent (rule zero sets them to 0)
    coordinates: int = 0  # coordinates of the global model
    indexed: int = 0  # explicit positions uploaded (sparse deltas), all selected clients together
    val_acc: float | None = None  # as ``acc``, on the clients' validation hold-outs (when evaluated)
    download_bytes: int = 0  # bytes the selected clients received for this round's model (LinkHooks only)
    epsilon: float | None = None  # private rounds: epsilon spent so far, at the federation's delta
    clip: float | None = None  # private rounds: this round's clip bound C
    dropped: int = 0  # secure rounds: selected devices that dropped out of the protocol
    abandoned: str | None = None  # secure rounds: why the round's sum could not be unmasked (model unchanged)

    @property
    def upload_fraction(self) -> float:
        return self.sent / self.numel if self.numel else 0.0

    @property
    def unsent_fraction(self) -> float:
        return self.unsent / self.coordinates if self.coordinates else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"round": self.round, "acc": self.acc, "loss": self.loss, "train_loss": self.train_loss,
                "selected": list(self.selected), "sent": self.sent, "numel": self.numel,
                "upload_fraction": self.upload_fraction, "upload_bytes": self.upload_bytes,
                "seconds": self.seconds, "client_acc": list(self.client_acc), "unsent": self.unsent,
                "unsent_fraction": self.unsent_fraction, "indexed": self.indexed, "val_acc": self.val_acc,
                "download_bytes": self.download_bytes, "epsilon": None if self.epsilon is None else "inf" if math.isinf(self.epsilon) else self.epsilon,
                "dp_clip": self.clip, "secure_dropped": self.dropped, "secure_abandoned": self.abandoned}
