"""The coordinator's inbox: every payload from the broker becomes a decision, a counter or an event.

:class:`Inbox` decodes and checks what arrives (topic, envelope, JSON message), routes update chunks
through screening (:func:`coordinator.intake.screen`), the size limit and the ChunkCollector, and
hands back complete, validated updates. Everything it refuses is counted, logged and -- for
updates, once per (re-)sent blob -- acknowledged with the reason. It owns no round state: the
coordinator passes the open round in.

Bounded work per sender: a blob whose envelope declares more than the round's model can hold is
refused at its first chunk (nothing is collected), and a device refused ``max_malformed`` times in
the open round (malformed, oversize, wrong sender or model, invalid, over the norm bound, bad
chunk) is cut off for the rest of that round: its update chunks are dropped at once, counted
``cut_off``, and it is told once why.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flayer.engine import Verdict, VersionWindow, refuse
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
from transport.link import MqttLink, Received

from .config import FederationSettings
from .intake import STRIKES, screen, validate
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
        self.strikes: Counter[tuple[int, str]] = Counter()  # (round, client) -> refusals that count
        self._cleared: set[str] = set()  # topics of retained junk this coordinator emptied (echo ignored)
        self._open: OpenRound | None = None
        # refusals while no round is open (between one round's close and the next one's opening): they
        # go into the next round's metrics, so the rounds' records add up to the cumulative counters
        self._between: Counter[tuple[str, str | None]] = Counter()
        self._between_details: deque[tuple[str, str, str | None]] = deque(maxlen=50)
        self.on_refuse: Callable[[str], None] | None = None  # a device's update was refused (async: slot freed)

    @property
    def open(self) -> OpenRound | None:
        """The round whose metrics the refusals go into (set by the coordinator)."""
        return self._open

    @open.setter
    def open(self, rnd: OpenRound | None) -> None:
        self._open = rnd
        if rnd is None:
            return
        for (counter, client), n in self._between.items():
            rnd.stats.refuse(counter, "", client, n)
        for counter, reason, client in self._between_details:
            rnd.stats.note(counter, reason, client)
        self._between.clear()
        self._between_details.clear()

    def count(self, counter: str, reason: str, client: str | None = None, *, n: int = 1,
              quiet: bool = False) -> None:
        """Count a refusal (cumulative, and in the metrics of the round open when it arrived -- or of the next
        round, when none was -- with its reason and device) and log it (unless ``quiet``)."""
        self.counters[counter] += n
        if self._open is not None:
            self._open.stats.refuse(counter, reason, client, n)
        else:
            self._between[(counter, client)] += n
            if reason:
                self._between_details.append((counter, reason, client))
        if not quiet:
            log.warning("%s: %s", counter, reason)

    def _strike(self, client: str, counter: str | None, digest: str = "0" * 64) -> None:
        rnd = self.open
        if rnd is None or counter not in STRIKES:
            return
        self.strikes[(rnd.number, client)] += 1
        if self.strikes[(rnd.number, client)] == self.fs.max_malformed:
            reason = (f"{client} is cut off for round {rnd.number}: {self.fs.max_malformed} refused updates or "
                      f"chunks (max_malformed)")
            log.warning("%s", reason)
            self.ack(client, rnd.number, digest, "rejected", reason)

    def cut_off(self, client: str) -> bool:
        rnd = self.open
        return rnd is not None and self.strikes[(rnd.number, client)] >= self.fs.max_malformed

    def ack(self, client: str, round_: int, digest: str, status: str, reason: str = "") -> None:
        payload = encode_message(Ack(round_, client, digest, status, reason[:500]), self.topics.federation,
                                 self.sender)
        self.link.publish(self.topics.ack(client), payload)

    def count_dropped(self, dropped: Mapping[str, int]) -> None:
        """Messages the receive queue dropped (coordinator.receive), by sender."""
        for sender, n in dropped.items():
            self.count("queue_full", f"{n} message(s) from {sender or 'no sender'} dropped: the receive queue "
                                     f"is full", sender or None, n=n)

    def not_input(self, parsed: ParsedTopic, ev: Received) -> bool:
        """True for what is no input: an empty payload (a retained message cleared; for updates only
        the echo of this coordinator's own clearing), and a retained update or metrics message -- a
        device left it on the broker: counted ``retained`` and emptied (an empty retained payload)."""
        if not ev.payload and (parsed.kind != "update" or ev.topic in self._cleared):
            self._cleared.discard(ev.topic)
            return True
        if ev.retain and parsed.kind in ("update", "metrics"):
            self.count("retained", f"{ev.topic}: a retained message from {parsed.client} is ignored and cleared",
                       parsed.client)
            self._cleared.add(ev.topic)
            self.link.publish(ev.topic, b"", retain=True)
            return True
        return False

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
            self.count("bad_message", f"{parsed.kind} of {parsed.client}: {exc.reason}", parsed.client)
            return None
        return env, msg

    def update_chunk(self, parsed: ParsedTopic, payload: bytes, done_round: int,
                     accepted_before: Mapping[int, set[str]], window: VersionWindow | None = None
                     ) -> CompleteUpdate | None:
        """One update chunk; the accepted update once its blob is complete and valid, else None.
        ``window``: an asynchronous federation's model versions (staleness, who was offered which)."""
        client = parsed.client
        assert client is not None
        rnd = self.open
        if self.cut_off(client):
            self.count("cut_off", "", client, quiet=True)
            return None
        try:
            env = decode_envelope(payload, self.limits)
            check_topic(env, parsed)
        except WireError as exc:
            self.count("bad_chunk", f"update chunk from {client}: {exc.reason}", client)
            self._strike(client, "bad_chunk")
            return None
        if rnd is None and window is not None:
            return None  # async, between one version's close and the next one's opening: the device re-sends
        if rnd is not None:
            rnd.stats.bytes_in += len(payload)
        verdict = screen(client, env.round, rnd.number if rnd else None, done_round,
                         rnd.selected if rnd else frozenset(), rnd.accepted if rnd else set(), accepted_before,
                         window)
        if verdict is None and rnd is not None and env.total_size > rnd.ctx.blob_cap:
            verdict = refuse("rejected", "oversize", f"update of {env.total_size} bytes exceeds {rnd.ctx.blob_cap} "
                                                     f"(max_update_bytes {self.fs.max_update_bytes}, or what the model "
                                                     f"holds)")
        if verdict is not None:
            key = (client, env.round, env.digest)
            if env.index == 0 or key not in self._answered:  # once per (re-)sent blob
                self._answered.add(key)
                self._refuse(client, env.round, env.digest, verdict)
            return None
        try:
            blob = self.collector.add(env)
        except WireError as exc:
            self.count("bad_chunk", f"update chunk from {client}: {exc.reason}", client)
            self._strike(client, "bad_chunk", env.digest)
            return None
        if blob is None:
            return None
        assert rnd is not None
        rnd.stats.received += 1
        verdict = validate(client, blob, rnd.ctx, env.round)
        if not verdict.accepted:
            self._refuse(client, env.round, env.digest, verdict)
            return None
        return CompleteUpdate(client, env.round, env.digest, blob, verdict)

    def _refuse(self, client: str, round_: int, digest: str, verdict: Verdict) -> None:
        assert verdict.counter is not None
        self.count(verdict.counter, f"{client} round {round_}: {verdict.reason}", client)
        self.ack(client, round_, digest, verdict.status, verdict.reason)
        self._strike(client, verdict.counter, digest)
        if self.on_refuse is not None:
            self.on_refuse(client)

    def _dropped(self, key: tuple[int, str, str, int, str], held: int, count: int, why: str) -> None:
        self.count("incomplete", f"{key[2]} round {key[3]}: unfinished update blob {key[4][:12]} dropped "
                                 f"with {held} of {count} chunks ({why})")

    def round_closed(self, number: int, keep_from: int | None = None) -> None:
        """Forget unfinished blobs (each counted ``incomplete``) and answers of rounds up to ``number``
        (asynchronous rounds: blobs trained from versions ``keep_from`` and later stay)."""
        oldest = number + 1 if keep_from is None else keep_from
        self.collector.discard((k for k in self.collector.keys() if k[3] < oldest), f"round {number} closed")
        self._answered = {k for k in self._answered if k[1] > number - 2}
        self.strikes = Counter({k: v for k, v in self.strikes.items() if k[0] > number})
