"""The coordinator's inbox: every payload from the broker becomes a decision, a counter or an event.

:class:`Inbox` decodes and checks what arrives (topic, envelope, JSON message), routes update chunks
through screening (:func:`coordinator.intake.screen`), the size limit and the ChunkCollector, and
hands back complete, validated updates. Everything it refuses is counted, logged and -- for
updates, once per (re-)sent blob -- acknowledged with the reason. It owns no round state: the
coordinator passes the open round in.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol import (
    Ack,
    ChunkCollector,
    Kind,
    Message,
    ParsedTopic,
    TopicError,
    Topics,
    WireError,
    WireLimits,
    check_topic,
    decode_envelope,
    decode_message,
    encode_message,
)
from transport.link import MqttLink

from .config import FederationSettings
from .intake import Verdict, screen, validate
from .open_round import OpenRound

__all__ = ["CompleteUpdate", "Inbox"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompleteUpdate:
    client: str
    round: int
    digest: str
    blob: bytes
    verdict: Verdict  # accepted


class Inbox:
    def __init__(self, link: MqttLink, topics: Topics, sender: str, limits: WireLimits, fs: FederationSettings,
                 counters: Counter[str]) -> None:
        self.link, self.topics, self.sender, self.limits, self.fs = link, topics, sender, limits, fs
        self.counters = counters
        self.collector = ChunkCollector(limits, fs.max_pending_bytes, on_drop=self._dropped)
        self._answered: set[tuple[str, int, str]] = set()
        self.open: OpenRound | None = None  # set by the coordinator: where per-round counts go

    def count(self, counter: str, reason: str) -> None:
        """Count a refusal (cumulative, and in the metrics of the round open when it arrived) and log it."""
        self.counters[counter] += 1
        if self.open is not None:
            self.open.stats.rejected[counter] += 1
        log.warning("%s: %s", counter, reason)

    def ack(self, client: str, round_: int, digest: str, status: str, reason: str = "") -> None:
        payload = encode_message(Ack(round_, client, digest, status, reason[:500]), self.topics.federation,
                                 self.sender)
        self.link.publish(self.topics.ack(client), payload)

    def parse(self, topic: str) -> ParsedTopic | None:
        try:
            return self.topics.parse(topic)
        except TopicError as exc:
            self.count("bad_message", f"{topic}: {exc}")
            return None

    def message(self, parsed: ParsedTopic, payload: bytes, kind: Kind) -> tuple[Any, Message] | None:
        """(envelope, message) of a status or metrics payload, or None (counted as bad_message)."""
        try:
            env, msg = decode_message(payload, self.limits, kind)
            check_topic(env, parsed)
        except WireError as exc:
            self.count("bad_message", f"{parsed.kind} of {parsed.client}: {exc.reason}")
            return None
        return env, msg

    def update_chunk(self, parsed: ParsedTopic, payload: bytes, done_round: int,
                     accepted_before: Mapping[int, set[str]]) -> CompleteUpdate | None:
        """One update chunk; the accepted update once its blob is complete and valid, else None."""
        client = parsed.client
        assert client is not None
        try:
            env = decode_envelope(payload, self.limits)
            check_topic(env, parsed)
        except WireError as exc:
            self.count("bad_chunk", f"update chunk from {client}: {exc.reason}")
            return None
        rnd = self.open
        if rnd is not None:
            rnd.stats.bytes_in += len(payload)
        verdict = screen(client, env.round, rnd.number if rnd else None, done_round,
                         rnd.selected if rnd else frozenset(), rnd.accepted if rnd else set(), accepted_before)
        if verdict is None and env.total_size > self.fs.max_update_bytes:
            verdict = Verdict("rejected", f"update of {env.total_size} bytes exceeds max_update_bytes "
                                          f"{self.fs.max_update_bytes}", "oversize")
        if verdict is not None:
            key = (client, env.round, env.digest)
            if env.index == 0 or key not in self._answered:  # once per (re-)sent blob
                self._answered.add(key)
                self._refuse(client, env.round, env.digest, verdict)
            return None
        try:
            blob = self.collector.add(env)
        except WireError as exc:
            self.count("bad_chunk", f"update chunk from {client}: {exc.reason}")
            return None
        if blob is None:
            return None
        assert rnd is not None
        rnd.stats.received += 1
        verdict = validate(client, blob, rnd.ctx)
        if not verdict.accepted:
            self._refuse(client, env.round, env.digest, verdict)
            return None
        return CompleteUpdate(client, env.round, env.digest, blob, verdict)

    def _refuse(self, client: str, round_: int, digest: str, verdict: Verdict) -> None:
        assert verdict.counter is not None
        self.count(verdict.counter, f"{client} round {round_}: {verdict.reason}")
        self.ack(client, round_, digest, verdict.status, verdict.reason)

    def _dropped(self, key: tuple[int, str, str, int, str], held: int, count: int, why: str) -> None:
        self.count("incomplete", f"{key[2]} round {key[3]}: unfinished update blob {key[4][:12]} dropped "
                                 f"with {held} of {count} chunks ({why})")

    def round_closed(self, number: int) -> None:
        """Forget unfinished blobs (each counted ``incomplete``) and answers of rounds up to ``number``."""
        self.collector.discard((k for k in self.collector.keys() if k[3] <= number), f"round {number} closed")
        self._answered = {k for k in self._answered if k[1] > number - 2}
