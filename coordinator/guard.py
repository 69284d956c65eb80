"""What keeps one hostile device from poisoning the aggregate: the automatic norm bound and the
quarantine of journaled updates that would make a global model non-finite.

Norm bound (``[federation]`` keys; an explicit ``norm_bound`` overrides it):

1. ``norm_auto`` = 0: no bound.
2. Fewer than ``norm_warmup`` accepted norms recorded: ``norm_auto`` x the L2 norm of the global model
   itself (an honest round moves a model by a small fraction of its own norm).
3. Otherwise: ``norm_auto`` x the median of the last ``norm_window`` accepted norms.
4. One device's norms make at most a quarter of that history (``norm_window // 4``, at least 1): its
   older norms make way for its newer ones, so a device folded into every round or version cannot
   fill the history and set the median alone.

The bound of a round is fixed when it opens and the history is saved in the checkpoint, so a
restart replays the round's journal under the same bound.

Quarantine: ``<state_dir>/quarantine.jsonl``, one JSON line per journaled update (round, client,
blob digest, reason) that made the round's aggregate non-finite; a replay skips them.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flayer.aggregate import is_finite_state
from flayer.files import open_private

__all__ = ["NormHistory", "Quarantine", "finite_fold", "state_norm"]

log = logging.getLogger(__name__)
QUARANTINE_NAME = "quarantine.jsonl"


def state_norm(state: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of a model state, over all its floating-point tensors (float64 sums)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in state.values() if t.is_floating_point()))


@dataclass
class NormHistory:
    """The recent accepted update norms and the bound they give (module docstring, rules 1-3)."""

    auto: float
    window: int
    warmup: int
    norms: list[float] = field(default_factory=list)
    clients: list[str] = field(default_factory=list)  # whose each norm was ("": not known)

    def bound(self, explicit: float | None, global_state: Mapping[str, torch.Tensor]) -> float | None:
        if explicit is not None:
            return explicit
        if self.auto <= 0:
            return None
        if len(self.norms) < self.warmup:
            return self.auto * max(state_norm(global_state), 1e-6)
        return self.auto * max(statistics.median(self.norms[-self.window:]), 1e-12)

    @property
    def share(self) -> int:
        """The most norms of one device the history keeps (rule 4)."""
        return max(1, self.window // 4)

    def add(self, norms: Iterable[float], clients: Iterable[str] | None = None) -> None:
        """Record accepted norms, oldest first; ``clients``: whose each is (rule 4; None: not known)."""
        pairs = list(zip(self.clients, self.norms)) if len(self.clients) == len(self.norms) \
            else [("", n) for n in self.norms]
        for client, n in zip(clients if clients is not None else itertools.repeat(""), norms):
            if not math.isfinite(n):
                continue
            pairs.append((client, n))
            if client:
                mine = [i for i, (c, _) in enumerate(pairs) if c == client]
                if len(mine) > self.share:
                    del pairs[mine[0]]
        pairs = pairs[-self.window:]
        self.clients = [c for c, _ in pairs]
        self.norms = [n for _, n in pairs]


class Quarantine:
    """The quarantined journal records of a state folder (module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / QUARANTINE_NAME
        self.entries: set[tuple[int, str, str]] = set()
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.entries.add((int(rec["round"]), str(rec["client"]), str(rec["digest"])))
                except (ValueError, KeyError, TypeError):
                    log.error("%s: unreadable line skipped: %.200s", self.path, line)

    def __contains__(self, key: tuple[int, str, str]) -> bool:
        return key in self.entries

    def add(self, round_: int, client: str, digest: str, reason: str) -> None:
        """Record (fsynced) before the round's checkpoint is written; an I/O error is raised as OSError
        naming the file."""
        self.entries.add((round_, client, digest))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open_private(self.path, "a") as fh:
                fh.write(json.dumps({"round": round_, "client": client, "digest": digest, "reason": reason}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from exc
        log.error("round %d: the update of %s (%s) is quarantined: %s", round_, client, digest[:12], reason)


def finite_fold(fresh: Callable[[], Any], updates: Iterable[tuple[Any, Callable[[Any], None]]]
                ) -> tuple[Any, list[Any]]:
    """Fold ``updates`` one at a time into ``fresh()``, keeping each only when the aggregate stays
    finite. ``updates``: (key, fold function taking the aggregator); returns (aggregator, keys left out).
    Costs a copy of the aggregator and one result per update: for the rare round whose plain
    aggregate was not finite."""
    agg = fresh()
    left_out: list[Any] = []
    for key, fold in updates:
        trial = copy.deepcopy(agg)
        try:
            fold(trial)
            bad = is_finite_state(trial.result())
        except (ValueError, FloatingPointError, OverflowError) as exc:
            bad = str(exc)
        if bad is None:
            agg = trial
        else:
            left_out.append(key)
    return agg, left_out
