"""A ``tuned.json`` of ``flayer tune`` as ``flayer bench --tuned`` and ``flayer ablate --tuned`` read it: the
grid point of a method (:class:`Point`, whose label names its run folder), the choice per method and
:func:`load_tuned`, which checks the file against the run that reads it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.common import CliError

__all__ = ["FORMAT", "Choice", "Point", "load_tuned"]

FORMAT = "flayer-tune/1"


@dataclass(frozen=True)
class Point:
    """One grid point of one method."""

    method: str
    lr: float
    sets: tuple[str, ...] = ()  # "STRATEGY.KEY=VALUE" knobs

    @property
    def label(self) -> str:
        knobs = "".join(f"_{s.split('.', 1)[1]}" for s in self.sets)
        return f"lr{self.lr:g}{knobs}"


@dataclass(frozen=True)
class Choice:
    method: str
    lr: float
    sets: tuple[str, ...]
    val_acc: float
    test_acc: float

    def as_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "set": list(self.sets), "best_val_acc": self.val_acc, "best_test_acc": self.test_acc}


def load_tuned(path: Path, methods: Sequence[str], cfg: Any, pick: str = "best") -> dict[str, Choice]:
    """The choices of a ``tuned.json`` for ``methods`` (``pick``: "best", the best validation accuracy,
    or "stable", :func:`choose_stable`); CliError naming what is wrong."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise CliError(f"--tuned {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise CliError(f"--tuned {path}: not valid JSON ({exc})") from None
    which = "choice" if pick == "best" else "stable_choice"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("choice"), dict):
        raise CliError(f"--tuned {path}: not a tuned.json written by 'flayer tune' (format {FORMAT})")
    if not isinstance(doc.get(which), dict):
        raise CliError(f"--tuned {path}: no {which} (written by an older 'flayer tune': run it again to re-tabulate)")
    settings = doc.get("settings") or {}
    for key, value in (("dataset", cfg.data.dataset), ("partition", cfg.data.partition)):
        if settings.get(key) != value:
            raise CliError(f"--tuned {path}: tuned on {key} {settings.get(key)!r}, this bench runs {value!r}")
    missing = [m for m in methods if m not in doc[which]]
    if missing:
        raise CliError(f"--tuned {path}: no {'stable ' if pick == 'stable' else ''}choice for {', '.join(missing)} "
                       f"(every grid point diverged{', or its next rate did' if pick == 'stable' else ''}, or the "
                       f"method was not tuned)")
    out = {}
    for m in methods:
        c = doc[which][m]
        try:
            lr, sets = float(c["lr"]), tuple(str(x) for x in c.get("set", []))
            val, test = float(c["best_val_acc"]), float(c["best_test_acc"])
        except (KeyError, TypeError, ValueError):
            raise CliError(f"--tuned {path}: the choice for {m} is malformed: {c!r}") from None
        if not (math.isfinite(lr) and 0 < lr <= 10):
            raise CliError(f"--tuned {path}: the learning rate chosen for {m} is out of range: {lr}")
        if any(not s.startswith(f"{m}.") for s in sets):
            raise CliError(f"--tuned {path}: the options chosen for {m} name another method: {list(sets)}")
        out[m] = Choice(m, lr, sets, val, test)
    return out
