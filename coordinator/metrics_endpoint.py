"""The coordinator's Prometheus endpoint (``metrics_port``): started with the run, closed at its end, after up to
``metrics_linger_s`` for one more scrape of the final values (:mod:`coordinator.exporter`)."""

from __future__ import annotations

import logging
from pathlib import Path

from .config import FederationSettings
from .exporter import FleetMetrics, MetricsServer, read_token
from .result import CoordinatorError

__all__ = ["MetricsEndpoint"]

log = logging.getLogger("coordinator.server")


class MetricsEndpoint:
    """Owns the HTTP server of :class:`coordinator.exporter.FleetMetrics` (``server``: None while none runs)."""

    def __init__(self, exporter: FleetMetrics, fs: FederationSettings, token_file: Path | None,
                 state_dir: Path) -> None:
        self.exporter, self.fs, self.token_file, self.state_dir = exporter, fs, token_file, state_dir
        self.server: MetricsServer | None = None

    def start(self, done_round: int, now: float) -> None:
        """Start the endpoint when ``metrics_port`` is set (CoordinatorError when it cannot)."""
        self.exporter.restored(done_round, now)
        fs = self.fs
        if fs.metrics_port is None:
            return
        try:
            token = read_token(self.token_file, fs.metrics_host, self.state_dir)
            self.server = MetricsServer(self.exporter.registry, fs.metrics_host, fs.metrics_port, token)
        except ValueError as exc:
            raise CoordinatorError(str(exc)) from None
        except OSError as exc:
            raise CoordinatorError(f"metrics: cannot listen on {fs.metrics_host}:{fs.metrics_port}: "
                                   f"{exc.strerror or exc}") from None
        self.server.serve_in_thread()
        log.info("Prometheus metrics at %s%s", self.server.url,
                 " (token required: Authorization: Bearer)" if self.server.token else "")

    def close(self, finished: bool) -> None:
        """After the last round (``finished``), up to ``metrics_linger_s`` for one more scrape; then closed."""
        server, self.server = self.server, None
        if server is None:
            return
        if finished and self.fs.metrics_linger_s > 0 and \
                not server.wait_scrape(server.scrapes, self.fs.metrics_linger_s):
            log.info("metrics: no scrape of the final values within %.0f s", self.fs.metrics_linger_s)
        server.close()
