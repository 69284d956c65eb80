"""``--tensorboard DIR``: the run's metrics as TensorBoard scalars, written as the rounds close.

Reads the run's own metrics file (the schema of ``docs/reference/metrics.md``), so ``simulate``,
``coordinator`` and ``emulate`` log the same scalars: ``acc``, ``train_loss``, ``bytes_up_mb``,
``bytes_down_mb``, ``reported``, ``selected``, ``refused`` and ``wall_s`` per round. Needs the
``tensorboard`` package (torch's SummaryWriter writes the files); without it the flag is skipped with
a warning and the run goes on.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_tensorboard_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write per-round scalars for TensorBoard under DIR (needs the tensorboard package)")


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of one ``round`` record (absent values left out)."""
    out = {"acc": rec["acc"], "train_loss": rec["train_loss"], "bytes_up_mb": rec["bytes_up"] / 1e6,
           "bytes_down_mb": rec["bytes_down"] / 1e6, "reported": rec["reported"], "selected": len(rec["selected"]),
           "refused": sum(rec["refused"].values()), "wall_s": rec["wall_s"]}
    return {k: float(v) for k, v in out.items() if v is not None}


class TensorBoardSink:
    """Follows a metrics file; :meth:`poll` writes the scalars of the rounds closed since the last call."""

    def __init__(self, logdir: str | Path, metrics: Path) -> None:
        from coordinator.dashboard.watch import MetricsTail

        self.tail = MetricsTail(metrics)
        self.writer: Any = None
        try:
            import tensorboard  # noqa: F401 -- torch's SummaryWriter needs it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("--tensorboard %s: the tensorboard package is not installed (pip install tensorboard); "
                        "skipping the scalars", logdir)
            return
        self.writer = SummaryWriter(str(logdir))

    def poll(self) -> int:
        if self.writer is None:
            return 0
        n = 0
        for rec in self.tail.read():
            if rec["kind"] == "round":
                for name, value in scalars(rec).items():
                    self.writer.add_scalar(f"{rec['source']}/{name}", value, rec["round"])
                n += 1
        self.writer.flush()
        return n

    def close(self) -> None:
        self.poll()
        if self.writer is not None:
            self.writer.close()
