"""The pure pieces behind the fault suite's fixes: the chunk collector under a sender's flood and under
a contradicting chunk; a model download resumed after a reconnect or a stall."""

from __future__ import annotations

import hashlib

import pytest
from craft import patch

from edge_client.download import ModelDownload
from protocol import (
    DEFAULT_LIMITS,
    ChunkCollector,
    Kind,
    Topics,
    WireError,
    chunk_blob,
    decode_envelope,
)

pytestmark = pytest.mark.faults


def _chunks(blob: bytes, sender: str = "dev-a", size: int = 300 + 64) -> list[bytes]:  # 64: the signature field
    return chunk_blob(blob, Kind.UPDATE_CHUNK, "fed", sender, 1, size)


def _blob(i: int, n: int = 1000) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (n // 32)


def test_a_sender_cannot_crowd_out_the_others() -> None:
    dropped: list[tuple[str, int, int, str]] = []
    c = ChunkCollector(
        max_pending_blobs=10,
        max_blobs_per_sender=3,
        on_drop=lambda key, held, count, why: dropped.append((key[2], held, count, why)),
    )
    for i in range(50):  # first chunks only, each of another blob
        assert c.add(decode_envelope(_chunks(_blob(i))[0])) is None
    assert len(c.keys()) == 3 and len(dropped) == 47
    assert all(d[0] == "dev-a" and d[1] == 1 and d[2] == 5 and "evicted" in d[3] for d in dropped)
    honest = _blob(999)
    out = [c.add(decode_envelope(p)) for p in _chunks(honest, "dev-b")]
    assert out[-1] == honest  # another sender's blob still fits
    c.discard(c.keys(), "round closed")
    assert len(dropped) == 50 and dropped[-1][3] == "round closed" and c.pending_bytes == 0


def test_a_contradicting_chunk_starts_the_blob_over_so_a_resend_gets_through() -> None:
    dropped: list[str] = []
    c = ChunkCollector(on_drop=lambda key, held, count, why: dropped.append(why))
    blob = _blob(1)
    parts = _chunks(blob)
    assert len(parts) == 5
    c.add(decode_envelope(patch(parts[0], "count", 7)))  # damaged: claims 7 chunks
    c.add(decode_envelope(parts[1]))  # contradicts it: the blob starts over from this chunk
    assert len(dropped) == 1 and "starts over" in dropped[0]
    done = [c.add(decode_envelope(p)) for p in parts]
    assert done[-1] == blob and c.keys() == [] and c.pending_bytes == 0
    # a chunk that is bad on its own is still refused, and the held blob kept
    c.add(decode_envelope(parts[0]))
    with pytest.raises(WireError):
        c.add(decode_envelope(patch(parts[1], "total", 10**9)))
    assert c.missing(decode_envelope(parts[0]).blob_key) == [1, 2, 3, 4]


class _Link:
    """Records (un)subscriptions: the download's only use of the link."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def subscribe(self, filters: list[str]) -> None:
        self.calls.append(("sub", list(filters)))

    def unsubscribe(self, filters: list[str]) -> None:
        self.calls.append(("unsub", list(filters)))


def test_a_resumed_download_asks_only_for_what_is_missing() -> None:
    t = Topics("fed")
    blob = _blob(7, 3000)
    parts = chunk_blob(blob, Kind.MODEL_CHUNK, "fed", "coordinator", 1, 300)
    digest = decode_envelope(parts[0]).digest
    link = _Link()
    d = ModelDownload(link, t, digest, DEFAULT_LIMITS, 0.0, chunks=len(parts))  # type: ignore[arg-type]
    assert link.calls == [("sub", [t.model_filter(digest)])]
    d.resubscribe(1.0)  # nothing arrived yet: the plan's count names every chunk
    assert link.calls[-1] == ("sub", [t.model_chunk(digest, i) for i in range(len(parts))])
    for i in (0, 2, 3, 5):
        assert d.add(parts[i], 2.0) is None
    d.add(parts[2], 2.0)  # a repeat
    link.calls.clear()
    d.resume(3.0, session_present=True)  # the broker kept the session: its queue brings the rest
    assert link.calls == [] and d.held_at_resume == 4
    d.resume(4.0, session_present=False)  # the session is gone: ask for the missing chunks only
    missing = [i for i in range(len(parts)) if i not in (0, 2, 3, 5)]
    assert link.calls == [("sub", [t.model_chunk(digest, i) for i in missing])]
    done = [d.add(parts[i], 5.0) for i in missing]
    assert done[-1] == blob
    assert d.stats() == {
        "chunks": len(parts),
        "received": len(parts) + 1,
        "repeated": 1,
        "resumes": 2,
        "held_at_resume": 4,
    }
    d.cancel()
    assert link.calls[-1][0] == "unsub" and t.model_filter(digest) in link.calls[-1][1]
    assert set(link.calls[-1][1]) >= {t.model_chunk(digest, i) for i in missing}
