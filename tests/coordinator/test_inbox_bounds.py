"""The inbox under junk: what it remembers and logs stays bounded whatever a device sends, junk refused
before decoding counts towards the cut-off while an honest device's late update does not, and one
device's unfinished blobs cannot get another device's chunks refused."""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from coordinator.config import FederationSettings
from coordinator.inbox import ANSWERED_PER_SENDER, LOG_FIRST, AnsweredBlobs, CompleteUpdate, Inbox
from coordinator.intake import IntakeContext
from coordinator.metrics import RoundStats
from flayer.update import TensorDelta, Update
from protocol import Kind, Topics, UpdateHeader, WireLimits, chunk_blob, decode_message, encode_update

SHAPES = {"w": (4, 3), "b": (4,)}
BASE = "ab" * 32
T = Topics("fed")


class _Link:
    """Records what the inbox publishes (its acks)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.sent.append((topic, payload))

    def acks(self, client: str) -> list[Any]:
        return [decode_message(p)[1] for t, p in self.sent if t == T.ack(client)]


def _inbox(**fs: Any) -> tuple[Inbox, _Link]:
    link = _Link()
    return Inbox(link, T, "coord", WireLimits(), FederationSettings(credentials="c.toml", **fs), Counter()), link  # type: ignore[arg-type]


def _open(inbox: Inbox, number: int, selected: set[str], max_update_bytes: int = 1 << 20) -> Any:
    ctx = IntakeContext("fed", number, {number: BASE}, SHAPES, WireLimits(), max_update_bytes)
    rnd = SimpleNamespace(number=number, selected=frozenset(selected), accepted=set(), ctx=ctx,
                          stats=RoundStats(round=number, selected=sorted(selected), opened_at=0.0))
    inbox.open = rnd  # type: ignore[assignment]
    return rnd


def _send(inbox: Inbox, client: str, round_: int, blob: bytes, size: int = 10_000,
          only: list[int] | None = None) -> list[CompleteUpdate | None]:
    """The chunks of ``blob`` (or those at ``only``) through the inbox, round ``round_`` - 1 closed."""
    payloads = chunk_blob(blob, Kind.UPDATE_CHUNK, "fed", client, round_, size)
    return [inbox.update_chunk(T.parse(T.update_chunk(client, round_, i)), payloads[i], round_ - 1, {})
            for i in (only if only is not None else range(len(payloads)))]


def _update(client: str, round_: int) -> bytes:
    rng = np.random.default_rng(0)
    deltas = {k: TensorDelta(s, rng.standard_normal(int(np.prod(s))).astype(np.float32) * 0.1)
              for k, s in SHAPES.items()}
    return encode_update(Update(deltas, 10), UpdateHeader("fed", round_, client, BASE))


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coordinator.inbox"]


def test_a_flood_refused_before_decoding_is_counted_but_remembered_and_logged_boundedly(
        caplog: pytest.LogCaptureFixture) -> None:
    """10,000 one-chunk blobs, each another (so each is answered): 6,000 for the closed round 4 (late),
    4,000 for round 5, which does not select the sender (not_selected). All counted and acked; the blobs
    remembered as answered stay within the per-sender bound; the log holds the first few lines and, at the
    round's close, one summary line per device."""
    caplog.set_level(logging.WARNING, logger="coordinator")
    inbox, link = _inbox()
    rnd = _open(inbox, 5, {"dev-a"})
    for i in range(10_000):
        assert _send(inbox, "dev-x", 4 if i < 6000 else 5, f"junk {i}".encode()) == [None]
    assert inbox.counters == {"late": 6000, "not_selected": 4000} == rnd.stats.rejected
    assert len(link.acks("dev-x")) == 10_000 and not inbox.cut_off("dev-x")  # honest kinds: never strikes
    assert len(inbox._answered) <= ANSWERED_PER_SENDER
    assert len(_lines(caplog)) == LOG_FIRST + 1 and "summed up when it closes" in _lines(caplog)[-1]
    inbox.round_closed(5)
    assert _lines(caplog)[-1] == f"dev-x: {10_000 - LOG_FIRST:,} more refusals (late: {6000 - LOG_FIRST:,}, " \
                                 "not_selected: 4,000) in round 5"
    _open(inbox, 6, {"dev-a"})  # a new round: its first refusals are logged again
    _send(inbox, "dev-x", 5, b"late again")
    assert _lines(caplog)[-1].startswith("late: dev-x round 5") and len(_lines(caplog)) == LOG_FIRST + 3


def test_every_refusal_up_to_the_cut_off_is_logged_when_max_malformed_is_larger(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator")
    inbox, _ = _inbox(max_malformed=40)
    _open(inbox, 5, {"dev-a"})
    for i in range(50):
        _send(inbox, "dev-x", 4, f"junk {i}".encode())
    assert len(_lines(caplog)) == 40 + 1
    inbox.round_closed(5)
    assert _lines(caplog)[-1] == "dev-x: 10 more refusals (late: 10) in round 5"


def test_answered_blobs_are_bounded_per_sender_and_in_senders() -> None:
    a = AnsweredBlobs(per_sender=2, senders=3)
    for r in range(5):
        a.add(("dev-x", r, "d"))
    assert len(a) == 2 and ("dev-x", 4, "d") in a and ("dev-x", 3, "d") in a and ("dev-x", 2, "d") not in a
    a.add(("dev-x", 3, "d"))  # answered again: the most recent now
    a.add(("dev-x", 9, "d"))
    assert ("dev-x", 3, "d") in a and ("dev-x", 4, "d") not in a
    for s in ("s1", "s2", "s3"):
        a.add((s, 1, "d"))
    assert len(a) == 3 and ("dev-x", 9, "d") not in a  # the least recently answered sender is forgotten
    a.forget_rounds(1)
    assert len(a) == 0


def test_a_late_update_does_not_cut_a_device_off_but_junk_before_decoding_does() -> None:
    """Default max_malformed (3). dev-a's update for the closed round, sent and re-sent twice, is refused
    ``late`` three times and does not count: its update for the open round is accepted. dev-b's three
    blobs for a round no plan names yet (``future_round``) cut it off for the round."""
    inbox, link = _inbox()
    _open(inbox, 5, {"dev-a", "dev-b"})
    late = _update("dev-a", 4)
    for _ in range(3):
        assert _send(inbox, "dev-a", 4, late, size=150 + 64) == [None] * 3  # 3 chunks; each send answered once
    assert inbox.counters == {"late": 3} and not inbox.cut_off("dev-a")
    (done,) = _send(inbox, "dev-a", 5, _update("dev-a", 5))
    assert done is not None and done.verdict.accepted
    for i in range(3):
        _send(inbox, "dev-b", 6, f"future {i}".encode())
    assert inbox.counters["future_round"] == 3 and inbox.cut_off("dev-b")
    assert "cut off" in link.acks("dev-b")[-1].reason
    assert _send(inbox, "dev-b", 5, _update("dev-b", 5)) == [None] and inbox.counters["cut_off"] == 1


def test_unfinished_blobs_of_one_device_do_not_get_anothers_chunks_refused() -> None:
    """dev-a holds the whole max_pending_bytes in four unfinished blobs (alone, its share is all of it). dev-b's
    update is then accepted, not refused ``bad_chunk`` (which would count towards dev-b's cut-off): dev-a, over
    its share, loses its oldest blob (``incomplete``, no strike either)."""
    inbox, _ = _inbox(max_update_bytes=4000, max_pending_bytes=8000, max_malformed=1)
    _open(inbox, 5, {"dev-a", "dev-b"}, max_update_bytes=4000)
    body = 2000
    size = body + len(chunk_blob(b"x", Kind.UPDATE_CHUNK, "fed", "dev-a", 5, 1000)[0]) - 1
    for i in range(4):  # the first half of each: 2,000 bytes held per blob
        blob = np.random.default_rng(i).bytes(2 * body)
        assert _send(inbox, "dev-a", 5, blob, size=size, only=[0]) == [None]
    assert inbox.collector.pending_bytes == 8000 and not inbox.counters
    (done,) = _send(inbox, "dev-b", 5, _update("dev-b", 5))
    assert done is not None and done.verdict.accepted
    assert inbox.counters == {"incomplete": 1} and inbox.strikes == Counter() and not inbox.cut_off("dev-b")
    assert inbox.collector.pending_bytes == 6000 == inbox.collector.held_by("dev-a")
