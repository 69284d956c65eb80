"""What the virtual fleet (:mod:`emulator.virtual`) takes and gives: the federation settings its simulated
clock needs (:class:`FleetTiming`), devices' online stretches from their availability timelines, link
times, the links' interface (:class:`VirtualLinks`: emulator.thinsim implements it) and the result."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from flayer.engine import AsyncSettings
from flayer.update import Update

__all__ = ["INF", "FleetTiming", "Interval", "VirtualLinks", "VirtualResult", "link_s", "next_online",
           "online_intervals"]

INF = math.inf
Interval = tuple[float, float]


def online_intervals(timeline: Iterator[tuple[float, str]], horizon: float) -> list[Interval]:
    """The online stretches ``[start, end)`` of a device timeline, up to ``horizon``."""
    out: list[Interval] = []
    start: float | None = None
    for t, event in timeline:
        if t > horizon:
            break
        if event == "online":
            start = t if start is None else start
        elif start is not None:  # offline or crash
            out.append((start, t))
            start = None
    if start is not None:
        out.append((start, INF))
    return out


def next_online(intervals: Sequence[Interval], t: float) -> Interval | None:
    for s, e in intervals:
        if e > t:
            return max(s, t), e
    return None


def link_s(nbytes: int, mbps: float, latency_ms: float) -> float:
    return (nbytes * 8 / (mbps * 1e6) if mbps > 0 else 0.0) + latency_ms / 1000


@dataclass(frozen=True)
class FleetTiming:
    """The federation settings the simulated clock needs (``[federation]`` keys)."""

    mode: str = "sync"
    quorum: int = 1
    over_selection: float = 1.3
    min_devices: int = 1
    deadline_s: float = 120.0
    grace_s: float = 3.0
    max_samples: int = 100_000
    budget_s: float = INF  # simulated seconds; the run also ends after ``rounds`` versions
    sample_cost_s: float | None = None  # compute seconds per sample at slowdown 1 (None: measure)
    asynchronous: AsyncSettings = field(default_factory=AsyncSettings)
    uplink_kbps: float = 0.0  # [edge] uplink_kbps: the rate fitted uploads plan on (0: each device's estimate)
    max_update_bytes: int = 0  # the smaller of [federation] and [edge] max_update_bytes (0: none)


class VirtualLinks(Protocol):
    """What crosses the simulated links (module docstring); ``fit``: uploads are fitted to a budget."""

    fit: bool

    def upload(self, r: int, client: int, update: Update, budget: int = 0,
               unmeasured: bool = False) -> tuple[Update, int]: ...

    def publish(self, r: int, old: Mapping[str, torch.Tensor],
                new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def download(self, r: int, client: int, hold: bool = True) -> int: ...


@dataclass
class VirtualResult:
    rounds: list[dict[str, Any]]  # per version: round, t (simulated s), acc, accepted, staleness_mean
    # per profile: devices, trained, accepted, refused, lost; bytes_down (the downloads of the updates
    # trained), bytes_up (the uploads that arrived)
    profiles: dict[str, dict[str, Any]]
    final_acc: float
    final_client_acc: list[float]
    digests: list[str]  # of every model version, the first included
    cpu_s: float = 0.0

    def time_to(self, target: float) -> float | None:
        return next((r["t"] for r in self.rounds if r["acc"] >= target), None)
