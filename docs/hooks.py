"""MkDocs hook: the generated reference pages.

A page holding one of the markers below gets the marker replaced, at build time, by what the code
says: every ``flayer`` command and flag (from the argparse parsers), every key of every config file
(from the config dataclasses) and the Python API of the coordinator and the edge client (from their
signatures and docstrings). Nothing generated is committed, so nothing can drift.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[1])


def on_config(config: Any) -> Any:
    """The generators document this checkout's code, whatever else the environment has installed.
    (Not at import time: MkDocs removes the first entry of ``sys.path`` after loading a hook.)"""
    if sys.path[:1] != [ROOT]:
        sys.path.insert(0, ROOT)
    return config


def _api() -> str:
    from cli.docgen import python_api
    from coordinator.config import load_coordinator_config
    from coordinator.result import CoordinatorResult
    from coordinator.server import Coordinator
    from edge_client.client import EdgeClient
    from edge_client.config import load_device_config, load_device_data
    from transport.credentials import Credentials

    return python_api([Coordinator, CoordinatorResult, load_coordinator_config, EdgeClient, load_device_config,
                       load_device_data, Credentials])


def _cli() -> str:
    from cli.docgen import cli_reference

    return cli_reference()


def _config() -> str:
    from cli.configdoc import config_reference

    return config_reference()


MARKERS = {"<!-- flayer:cli -->": _cli, "<!-- flayer:config -->": _config, "<!-- flayer:api -->": _api}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
