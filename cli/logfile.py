"""``--log-file FILE`` of the long-running commands: their log records (INFO and up, or DEBUG with -vv)
also go to FILE, appended, with times, whatever the terminal shows."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from cli.common import CliError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_file_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-file", metavar="FILE",
                   help="also write the log (INFO and up; DEBUG with -vv) to FILE, appended")


def log_to_file(path: str | Path) -> logging.Handler:
    """Attach a file handler to the root logger (INFO, or lower when -vv set it lower); returns it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"--log-file {path}: {exc.strerror or exc}") from exc
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    level = min(root.level or logging.INFO, logging.INFO)
    handler.setLevel(level)
    root.addHandler(handler)
    if root.level > level:  # the terminal keeps its level through its own handler
        for h in root.handlers:
            if h is not handler and h.level == logging.NOTSET:
                h.setLevel(root.level)
        root.setLevel(level)
    return handler
