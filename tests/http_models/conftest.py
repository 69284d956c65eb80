"""Models over HTTP: a real nginx serving a folder (skipped cleanly where nginx is not installed), and a
byte-counting TCP proxy in front of it that can cut a response."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    from coordinator.model_server import NginxServer, find_nginx

    if find_nginx() is None:
        pytest.skip("nginx is not installed (make apt-http)")
    server = NginxServer(tmp_path / "models", tmp_path / "nginx").start()
    yield server
    server.stop()
