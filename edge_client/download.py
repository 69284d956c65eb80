"""Fetching a global model from its retained chunks, and what waits for the coordinator's ack.

:class:`ModelDownload` subscribes to ``model/<digest>/+`` and reassembles the chunks as they come,
in any order, keeping what it has across reconnects. After a reconnect whose broker session
survived, the subscription and the chunks queued for the device survive too: the broker sends on
what is still owed (re-delivering, flagged DUP, the messages in flight when the link died, as QoS
1 requires) and nothing is asked again. When the session is gone (the broker lost it), or when no
chunk came for a while, it subscribes to the topics of the missing chunks only, and the broker
re-sends just those retained chunks. So a device on a link that keeps dropping never asks for a
chunk it holds, and still finishes. The blob is returned only once its sha256 matches the digest.

:class:`Pending` is a message the device sent and the coordinator has not acknowledged yet -- an
update, or a calibration report -- with the exponential backoff (and jitter) of its re-sends.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from protocol import Kind, Reassembler, Topics, Trust, WireError, WireLimits, decode_envelope
from transport.link import MqttLink

__all__ = ["ModelDownload", "Pending"]

log = logging.getLogger(__name__)


class ModelDownload:
    """``chunks``: the model's chunk count from the plan (0 when unknown: the first chunk tells)."""

    SUBSCRIBE_BATCH = 100  # topics per SUBSCRIBE packet when asking for missing chunks

    def __init__(self, link: MqttLink, topics: Topics, digest: str, limits: WireLimits, now: float,
                 chunks: int = 0, trust: Trust | None = None) -> None:
        self.link, self.topics, self.digest, self.limits = link, topics, digest, limits
        self.trust = trust  # the coordinator's key: a chunk it did not sign is refused
        self.filter = topics.model_filter(digest)
        self.reasm = Reassembler(limits)
        self.chunks = chunks
        self.started = now
        self.last_chunk_at = now
        self.received = 0  # chunks taken
        self.repeated = 0  # ...of which this download held already
        self.resumes = 0  # reconnects during the download
        self.held_at_resume = 0  # chunks held at the last one
        self._asked: set[str] = set()  # per-chunk topics subscribed to
        link.subscribe([self.filter])

    def missing(self) -> list[int]:
        """Chunk indices still to come; empty while the count is unknown."""
        if self.reasm.count:
            return self.reasm.missing()
        return list(range(self.chunks))

    def resume(self, now: float, session_present: bool) -> None:
        """After a reconnect: ask for the missing chunks only if the broker lost this device's session."""
        self.resumes += 1
        self.held_at_resume = self.reasm.held_chunks
        self.last_chunk_at = now
        if not session_present:
            self.resubscribe(now)

    def resubscribe(self, now: float) -> None:
        """Ask the broker again for the retained chunks still missing (all of them when the count is
        not known yet)."""
        self.last_chunk_at = now
        missing = self.missing()
        if not missing:
            self.link.unsubscribe([self.filter])
            self.link.subscribe([self.filter])
            return
        topics = [self.topics.model_chunk(self.digest, i) for i in missing]
        self._asked.update(topics)
        for at in range(0, len(topics), self.SUBSCRIBE_BATCH):  # re-subscribing re-sends a retained message
            self.link.subscribe(topics[at:at + self.SUBSCRIBE_BATCH])

    def cancel(self) -> None:
        self.link.unsubscribe([self.filter, *sorted(self._asked)])

    def due(self, stall_s: float) -> float:
        return self.last_chunk_at + stall_s

    def stats(self) -> dict[str, int]:
        return {"chunks": self.reasm.count, "received": self.received, "repeated": self.repeated,
                "resumes": self.resumes, "held_at_resume": self.held_at_resume}

    def add(self, payload: bytes, now: float) -> bytes | None:
        """Take one chunk; the verified blob once complete (then unsubscribed), else None.
        WireError for a chunk that is not one of this model's."""
        self.last_chunk_at = now
        env = decode_envelope(payload, self.limits, self.trust)
        if env.kind != Kind.MODEL_CHUNK or env.digest != self.digest:
            raise WireError("model chunk of another model on this model's topic")
        self.received += 1
        held = self.reasm.held_chunks
        try:
            done = self.reasm.add(env)
        except WireError as exc:  # a copy published for another round: start over with this one
            log.info("model chunk %d conflicts with those held (%s); restarting the download", env.index, exc.reason)
            self.reasm, held = Reassembler(self.limits), 0
            done = self.reasm.add(env)
        self.repeated += int(self.reasm.held_chunks == held)
        if not done:
            return None
        blob = self.reasm.blob()
        self.cancel()
        return blob


@dataclass
class Pending:
    """A sent message awaiting its ack: ``kind`` update or calibration, its round and digest, the
    (topic, payload) items to publish again on a timeout."""

    kind: str
    round: int
    digest: str
    items: list[tuple[str, bytes, bool]]
    attempt: int = 0
    due: float | None = None  # when to re-send if no ack came; None while a publish is under way
    model: str = ""  # digest of the model it was computed from

    def schedule(self, now: float, ack_timeout_s: float, backoff_s: float, backoff_max_s: float,
                 rng: random.Random) -> None:
        """After a (re-)send: the ack timeout, plus ``min(backoff_max, backoff * 2**attempt)`` with up to
        50% jitter once it has been re-sent."""
        wait = ack_timeout_s
        if self.attempt:
            wait += min(backoff_max_s, backoff_s * 2 ** (self.attempt - 1)) * (1 + rng.uniform(0, 0.5))
        self.due = now + wait
