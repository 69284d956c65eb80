"""The launcher's watch on the round plan: it wraps the fleet up at the coordinator's ``final`` plan.

What it reads decides what every worker of its shard does (the final plan ends them all), so it believes only
plans the coordinator signed, checked against the coordinator's public key its credentials carry as every
device's kit does (:class:`protocol.PeerTrust`): a plan published by anyone else -- through a mistaken ACL, a
bridge, a broker or cluster defect -- is refused and counted, never acted on (docs/explanation/security.md).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from protocol import Kind, PeerTrust, Plan, Topics, WireError, WireLimits, decode_message

if TYPE_CHECKING:
    from transport import Credentials

__all__ = ["PlanWatch"]

log = logging.getLogger(__name__)


class PlanWatch:
    """A monitor connection on the plan topic; :meth:`poll` takes what came (on the launcher's thread)."""

    def __init__(self, creds: Credentials, on_plan: Callable[[Plan], None] | None = None) -> None:
        self.creds, self.on_plan = creds, on_plan
        self.trust = PeerTrust(creds.federation, creds.coordinator())  # CredentialsError: an earlier kit
        self.topic = Topics(creds.federation).round()
        self.events: queue.Queue[Any] = queue.Queue()
        self.link: Any = None
        self.final_seen = False
        self.seen_train = False
        self.refused = 0  # plans not signed by the coordinator's key (or malformed)

    def start(self) -> PlanWatch:
        from transport.credentials import mqtt_connect_settings
        from transport.link import MqttLink

        self.link = MqttLink(mqtt_connect_settings(self.creds), self.events.put, clean_session=True)
        self.link.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        if self.link is not None:
            self.link.stop(timeout=timeout)

    def poll(self) -> None:
        """Take the events that came: a final plan after a training plan (or a live one) sets ``final_seen``."""
        from transport.link import Connected, Received

        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            if isinstance(ev, Connected) and ev.ok:
                self.link.subscribe([self.topic])
            elif isinstance(ev, Received) and ev.payload:
                try:
                    _, plan = decode_message(ev.payload, WireLimits(), Kind.PLAN, self.trust)
                except WireError as exc:
                    self.refused += 1
                    log.warning("plan watch: refused a message on %s: %s", ev.topic, exc)
                    continue
                assert isinstance(plan, Plan)
                if plan.phase == "final" and (self.seen_train or not ev.retain):
                    self.final_seen = True
                elif plan.phase != "final":
                    self.seen_train = True
                    if self.on_plan is not None:
                        self.on_plan(plan)
