"""The coordinator's inbox: every payload from the broker becomes a decision, a counter or an event.

:class:`Inbox` decodes and checks what arrives (topic, envelope, JSON message), routes update chunks
through screening (:func:`coordinator.intake.screen`), the size limit and the ChunkCollector, and
hands back complete, validated updates. Everything it refuses is counted, logged and -- for
updates, once per (re-)sent blob -- acknowledged with the reason. It owns no round state: the
coordinator passes the open round in.

Bounded work per sender: a blob whose envelope declares more than the round's model can hold is
refused at its first chunk (nothing is collected), and a device refused ``max_malformed`` times in
the open round for junk no honest device sends (:data:`coordinator.intake.STRIKES`) is cut off for
the rest of that round: its update chunks are dropped at once, counted ``cut_off``, and it is told
once why. The strikes:

1. Refusals decided before decoding count when they are junk: ``future_round`` (no plan names that
   round yet), ``oversize`` (more than the model holds), and a chunk under another device's topic
   or otherwise broken (``bad_chunk``). ``late``, ``stale``, ``not_selected`` and ``duplicate`` never
   count: an honest device sends them (a slow link, a lost ack), and cutting it off would lose its
   next valid update, not the refused one.
2. Refusals after decoding all count (``malformed``, ``wrong_sender``, ``wrong_model``, ``invalid``,
   ``norm``), as do chunks the collector refuses (``bad_chunk``). A chunk the collector cannot
   hold because *other* senders filled ``max_pending_bytes`` is never refused: each sender has its
   share of that budget (:class:`protocol.ChunkCollector`), and the one over its share loses its
   oldest unfinished blob (counted ``incomplete``, not a strike).

Bounded bookkeeping: the blobs already answered (so that a refused blob's later chunks are not
answered again) are kept per sender, the latest ``ANSWERED_PER_SENDER`` of at most
``ANSWERED_SENDERS`` senders (:class:`AnsweredBlobs`); forgetting one costs at most one more ack.
Rate-limited logs (:class:`RefusalLog`): a device's first ``max(LOG_FIRST, max_malformed)``
refusals in a round are logged one by one, the rest summed up in one line per device when the
round closes ("dev-x: 9,874 more refusals (late: 9,000, not_selected: 874) in round 5"). Every
refusal is still counted, in the round's metrics and the cumulative counters.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
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
    SignatureError,
    SigningKey,
    TopicError,
    Topics,
    Trust,
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

__all__ = ["AnsweredBlobs", "CompleteUpdate", "Inbox", "RefusalLog"]

log = logging.getLogger(__name__)

ANSWERED_PER_SENDER = 16  # answered blobs remembered per sender (an honest one has one or two in flight)
ANSWERED_SENDERS = 2048  # senders whose answered blobs are remembered (the least recently answered go first)
LOG_FIRST = 5  # refusals of one device in one round logged one by one, at least (max_malformed if larger)
LOG_DEVICES = 4096  # devices told apart in a round's refusal summary; the rest are "other devices"


@dataclass(frozen=True)
class CompleteUpdate:
    client: str
    round: int
    digest: str
    blob: bytes
    verdict: Verdict  # accepted


class AnsweredBlobs:
    """(sender, round, digest) of blobs refused before decoding, bounded (see module docstring)."""

    def __init__(self, per_sender: int = ANSWERED_PER_SENDER, senders: int = ANSWERED_SENDERS) -> None:
        self.per_sender, self.senders = per_sender, senders
        self._by: OrderedDict[str, OrderedDict[tuple[int, str], None]] = OrderedDict()  # least recent first

    def __contains__(self, key: tuple[str, int, str]) -> bool:
        mine = self._by.get(key[0])
        return mine is not None and (key[1], key[2]) in mine

    def __len__(self) -> int:
        return sum(len(m) for m in self._by.values())

    def add(self, key: tuple[str, int, str]) -> None:
        sender, blob = key[0], (key[1], key[2])
        mine = self._by.setdefault(sender, OrderedDict())
        self._by.move_to_end(sender)
        mine[blob] = None
        mine.move_to_end(blob)
        if len(mine) > self.per_sender:
            mine.popitem(last=False)
        if len(self._by) > self.senders:
            self._by.popitem(last=False)

    def forget_rounds(self, up_to: int) -> None:
        """Forget the blobs of rounds ``up_to`` and earlier."""
        for sender in list(self._by):
            mine = self._by[sender]
            for blob in [b for b in mine if b[0] <= up_to]:
                del mine[blob]
            if not mine:
                del self._by[sender]


class RefusalLog:
    """Refusal warnings, rate-limited per device and round (see module docstring). ``first()``: how many of a
    device's refusals in a round are logged one by one (read only once a device has had ``LOG_FIRST``)."""

    OTHERS = "other devices"

    def __init__(self, first: Callable[[], int] = lambda: LOG_FIRST, devices: int = LOG_DEVICES) -> None:
        self.first, self.devices = first, devices
        self._shown: Counter[str] = Counter()  # this round's refusals by device, logged or not
        self._more: dict[str, Counter[str]] = {}  # this round's refusals not logged, by device and counter

    def warn(self, device: str | None, counter: str, reason: str, n: int = 1) -> None:
        who = device or "no sender"
        if who not in self._shown and len(self._shown) >= self.devices:
            who = self.OTHERS
        seen = self._shown[who]
        self._shown[who] += 1
        if seen < LOG_FIRST or seen < self.first():
            log.warning("%s: %s", counter, reason)
            return
        if who not in self._more:
            log.warning("%s: more than %d refusals in this round; the rest are summed up when it closes", who, seen)
        self._more.setdefault(who, Counter())[counter] += n

    def summarise(self, round_: int) -> None:
        """One line per device whose refusals were not all logged; then a new round starts."""
        for who, more in self._more.items():
            detail = ", ".join(f"{c}: {k:,}" for c, k in more.most_common())
            log.warning("%s: %s more refusals (%s) in round %d", who, f"{sum(more.values()):,}", detail, round_)
        self._shown.clear()
        self._more.clear()


class Inbox:
    def __init__(self, link: MqttLink, topics: Topics, sender: str, limits: WireLimits, fs: FederationSettings,
                 counters: Counter[str], key: SigningKey | None = None, trust: Trust | None = None) -> None:
        self.link, self.topics, self.sender, self.limits, self.fs = link, topics, sender, limits, fs
        self.key, self.trust = key, trust  # the coordinator's signing key; the devices' keys (coordinator.device_keys)
        self.counters = counters
        self.collector = ChunkCollector(limits, fs.max_pending_bytes, on_drop=self._dropped)
        self._answered = AnsweredBlobs()
        self.refusal_log = RefusalLog(lambda: self.fs.max_malformed)
        self.strikes: Counter[tuple[int, str]] = Counter()  # (round, client) -> refusals that count
        self._cleared: set[str] = set()  # topics of retained junk this coordinator emptied (echo ignored)
        self._open: OpenRound | None = None
        # refusals while no round is open (between one round's close and the next one's opening): they
        # go into the next round's metrics, so the rounds' records add up to the cumulative counters
        self._between: Counter[tuple[str, str | None]] = Counter()
        self._between_details: deque[tuple[str, str, str | None]] = deque(maxlen=50)

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
        round, when none was -- with its reason and device) and log it (unless ``quiet``; rate-limited per device
        and round, :class:`RefusalLog`)."""
        self.counters[counter] += n
        if self._open is not None:
            self._open.stats.refuse(counter, reason, client, n)
        else:
            self._between[(counter, client)] += n
            if reason:
                self._between_details.append((counter, reason, client))
        if not quiet:
            self.refusal_log.warn(client, counter, reason, n)

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

    def ack(self, client: str, round_: int, digest: str, status: str, reason: str = "", version: int = 0) -> None:
        payload = encode_message(Ack(round_, client, digest, status, reason[:500], version), self.topics.federation,
                                 self.sender, key=self.key)
        self.link.publish(self.topics.ack(client), payload)

    def count_dropped(self, dropped: Mapping[str, int]) -> None:
        """Messages the receive queue dropped (coordinator.receive), by sender."""
        for sender, n in dropped.items():
            self.count("queue_full", f"{n} message(s) from {sender or 'no sender'} dropped: the receive queue "
                                     f"is full", sender or None, n=n)

    def not_input(self, parsed: ParsedTopic, ev: Received) -> bool:
        """True for what is no input: an empty payload (a retained message cleared; for updates only
        the echo of this coordinator's own clearing), and a retained update, metrics or secure-round message -- a
        device left it on the broker: counted ``retained`` and emptied (an empty retained payload)."""
        if not ev.payload and (parsed.kind != "update" or ev.topic in self._cleared):
            self._cleared.discard(ev.topic)
            return True
        if ev.retain and parsed.kind in ("update", "metrics", "secagg"):
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
            env, msg = decode_message(payload, self.limits, kind, self.trust)
            check_topic(env, parsed)
        except SignatureError as exc:
            self.count("unsigned", f"{parsed.kind} under {parsed.client}: {exc.reason}", parsed.client)
            return None
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
            env = decode_envelope(payload, self.limits, self.trust)
            check_topic(env, parsed)
        except SignatureError as exc:  # not the device's: no strike, no answer (it may not have sent it at all)
            self.count("unsigned", f"update chunk under {client}: {exc.reason}", client)
            return None
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
        assert rnd is not None  # screen() refuses everything while no round is open
        self.collector.min_share = rnd.ctx.blob_cap  # every sender's share holds one whole update
        try:
            blob = self.collector.add(env)
        except WireError as exc:
            self.count("bad_chunk", f"update chunk from {client}: {exc.reason}", client)
            self._strike(client, "bad_chunk", env.digest)
            return None
        if blob is None:
            return None
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

    def _dropped(self, key: tuple[int, str, str, int, str], held: int, count: int, why: str) -> None:
        reason = f"{key[2]} round {key[3]}: unfinished update blob {key[4][:12]} dropped with {held} of {count} " \
                 f"chunks ({why})"
        self.count("incomplete", reason, quiet=True)  # not held against the device: no strike, no device row
        self.refusal_log.warn(key[2], "incomplete", reason)

    def round_closed(self, number: int, keep_from: int | None = None) -> None:
        """Forget unfinished blobs (each counted ``incomplete``) and answers of rounds up to ``number``
        (asynchronous rounds: blobs trained from versions ``keep_from`` and later stay)."""
        oldest = number + 1 if keep_from is None else keep_from
        self.collector.discard((k for k in self.collector.keys() if k[3] < oldest), f"round {number} closed")
        self._answered.forget_rounds(number - 2)
        self.strikes = Counter({k: v for k, v in self.strikes.items() if k[0] > number})
        self.refusal_log.summarise(number)
