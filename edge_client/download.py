"""Fetching a global model from its retained chunks, and what waits for the coordinator's ack.

:class:`ModelDownload` subscribes to ``model/<digest>/+`` and reassembles the chunks as they come,
in any order. It keeps what it has across reconnects: after one (or when no chunk came for a while)
it subscribes again, the broker re-sends every retained chunk, and the reassembler ignores the ones
it holds. The blob is returned only once its sha256 matches the digest.

:class:`Pending` is a message the device sent and the coordinator has not acknowledged yet -- an
update, or a calibration report -- with the exponential backoff (and jitter) of its re-sends.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from mqtt_broker.link import MqttLink
from protocol import Kind, Reassembler, Topics, WireError, WireLimits, decode_envelope

__all__ = ["ModelDownload", "Pending"]

log = logging.getLogger(__name__)


class ModelDownload:
    def __init__(self, link: MqttLink, topics: Topics, digest: str, limits: WireLimits, now: float) -> None:
        self.link, self.digest, self.limits = link, digest, limits
        self.filter = topics.model_filter(digest)
        self.reasm = Reassembler(limits)
        self.last_chunk_at = now
        link.subscribe([self.filter])

    def resubscribe(self, now: float) -> None:
        """Ask for every retained chunk again (after a reconnect, or a stall)."""
        self.link.unsubscribe([self.filter])
        self.link.subscribe([self.filter])
        self.last_chunk_at = now

    def cancel(self) -> None:
        self.link.unsubscribe([self.filter])

    def due(self, stall_s: float) -> float:
        return self.last_chunk_at + stall_s

    def add(self, payload: bytes, now: float) -> bytes | None:
        """Take one chunk; the verified blob once complete (then unsubscribed), else None.
        WireError for a chunk that is not one of this model's."""
        self.last_chunk_at = now
        env = decode_envelope(payload, self.limits)
        if env.kind != Kind.MODEL_CHUNK or env.digest != self.digest:
            raise WireError("model chunk of another model on this model's topic")
        try:
            done = self.reasm.add(env)
        except WireError as exc:  # a copy published for another round: start over with this one
            log.info("model chunk %d conflicts with those held (%s); restarting the download", env.index, exc.reason)
            self.reasm = Reassembler(self.limits)
            done = self.reasm.add(env)
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
