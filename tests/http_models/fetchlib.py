"""A device's model fetch without the rest of the device: :class:`edge_client.fetch.ModelFetch` over a
link that records its subscriptions (the real device: :class:`edge_client.client.EdgeClient`)."""

from __future__ import annotations

import queue
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edge_client.delta_fetch import HeldModel
from edge_client.fetch import ModelFetch
from protocol import PeerTrust, SigningKey, Topics, WireLimits

__all__ = ["FetchDevice", "RecordedLink"]


class RecordedLink:
    def __init__(self) -> None:
        self.subscribed: list[str] = []

    def subscribe(self, topics: list[str]) -> None:
        self.subscribed += topics

    def unsubscribe(self, topics: list[str]) -> None: ...


COORD_KEY = SigningKey.generate()  # the coordinator's key, which the device's kit carries


class FetchDevice(ModelFetch):
    """The state ModelFetch needs (the real device: edge_client.client.EdgeClient); a recorded link."""

    def __init__(self, state_dir: Path, http_timeout_s: float = 5.0, http_deadline_s: float = 600.0,
                 username: str = "dev", password: str = "") -> None:
        self.id, self.link, self.topics, self.limits = "dev", RecordedLink(), Topics("fed"), WireLimits()  # type: ignore[assignment]
        self.settings = SimpleNamespace(state_dir=str(state_dir), http_models=True,
                                        http_timeout_s=http_timeout_s, http_deadline_s=http_deadline_s,
                                        models_hosts=(), models_plain_http=False)
        # the broker's host: the model servers of these tests listen there (the token goes to no other host)
        self.creds = SimpleNamespace(tls=None, username=username, password=password, host="127.0.0.1")
        self.plan = None
        self.trust = PeerTrust("fed", COORD_KEY.public)  # type: ignore[assignment]
        self.strategies = SimpleNamespace(get=lambda plan: None)  # type: ignore[assignment]
        self.clock, self.sleep, self.shaper = (lambda: 0.0), (lambda s: None), None
        self._download, self._delta, self._held, self._model, self._link_kbps = None, None, HeldModel(state_dir), None, None
        self._http, self._http_failed = None, set()
        self.events: queue.Queue[Any] = queue.Queue()
        self.progress: list[tuple[str, dict[str, Any]]] = []

    def _set_state(self, name: str) -> None: ...

    def _progress(self, kind: str, **info: Any) -> None:
        self.progress.append((kind, info))

    def _model_ready(self) -> None: ...
