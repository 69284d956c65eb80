"""PNG plots (matplotlib, Agg backend). Plotting is optional: without matplotlib it logs and skips."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'flayer-edge[plots]'); skipping plots")
        return None
    return plt


def line_plot(path: Path, series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str, title: str,
              x: Sequence[float] | None = None) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, ys in series.items():
        xs = list(x) if x is not None else list(range(1, len(ys) + 1))
        ax.plot(xs[: len(ys)], ys, label=name, linewidth=1.6)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if xlabel == "round":
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def bar_plot(path: Path, labels: Sequence[str], values: Sequence[float], ylabel: str, title: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(labels) + 2), 4), dpi=110)
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(labels)), labels, rotation=90 if len(labels) > 12 else 0, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
