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


def round_plots(out: Path, rounds: Sequence[Mapping[str, Any]], title: str, bytes_what: str) -> list[str]:
    """``accuracy.png`` and ``bytes.png`` from the ``round`` records of a metrics file (the same pair for
    ``flayer emulate`` and ``flayer coordinator``); returns the names written."""
    made: list[str] = []
    if not rounds:
        return made
    xs = [int(r["round"]) for r in rounds]
    if line_plot(out / "accuracy.png", {"mean device test acc": [r["acc"] or 0.0 for r in rounds]}, "round",
                 "test accuracy", title, x=xs):
        made.append("accuracy.png")
    plt = _pyplot()
    if plt is None:
        return made
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.bar([x - 0.2 for x in xs], [r["bytes_down"] / 1e6 for r in rounds], width=0.4, label="down (model chunks)")
    ax.bar([x + 0.2 for x in xs], [r["bytes_up"] / 1e6 for r in rounds], width=0.4, label="up (update chunks)")
    ax.set_xlabel("round")
    ax.set_ylabel(f"MB {bytes_what}")
    ax.set_title("bytes per round")
    ax.xaxis.get_major_locator().set_params(integer=True)  # rounds are whole numbers
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bytes.png")
    plt.close(fig)
    made.append("bytes.png")
    return made
