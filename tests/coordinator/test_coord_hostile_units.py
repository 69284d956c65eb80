"""The coordinator's defences against one hostile device, as units: the header and size checks that
run before any decompression, the weight cap, the automatic norm bound, the bounded fair receive
queue and the quarantine file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from coordinator.guard import NormHistory, Quarantine, finite_fold, state_norm
from flayer.engine import Bounds
from coordinator.intake import IntakeContext, validate
from coordinator.receive import ReceiveQueue, sender_of
from flayer.aggregate import make_aggregator
from flayer.update import TensorDelta, Update
from protocol import UpdateHeader, UpdateOptions, WireLimits, encode_update, payload_bound

SHAPES = {"w": (4, 3), "b": (4,)}
BASE = "ab" * 32


def _ctx(max_samples: int = 2**32, **kw: object) -> IntakeContext:
    args: dict[str, object] = {"federation": "fed", "round": 2, "bases": {2: BASE}, "shapes": SHAPES,
                               "limits": WireLimits(), "max_update_bytes": 1 << 26,
                               "bounds": Bounds(max_samples=max_samples), "payload_cap": payload_bound(SHAPES)}
    args.update(kw)
    return IntakeContext(**args)  # type: ignore[arg-type]


def _bomb(sender: str = "dev-1", base: str = BASE) -> bytes:
    pad = 16 * 2**20  # 64 MiB of zeros in a ~2 KB zstd frame
    return encode_update(Update({"pad": TensorDelta((pad,), np.zeros(pad, np.float32))}, 5),
                         UpdateHeader("fed", 2, sender, base), UpdateOptions(zstd=True, zstd_level=1))


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return _bomb()


def test_header_and_declared_size_are_checked_before_any_decompression(bomb: bytes, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import protocol.update_codec as codec

    assert len(bomb) < 4000
    monkeypatch.setattr(codec.zstandard, "ZstdDecompressor", lambda *a, **k: pytest.fail("decompressed"))
    for blob, counter in ((bomb, "oversize"), (_bomb(sender="dev-2"), "wrong_sender"),
                          (_bomb(base="cd" * 32), "wrong_model")):
        v = validate("dev-1", blob, _ctx())
        assert v.counter == counter, (counter, v.reason)


def test_blob_cap_follows_what_the_model_holds() -> None:
    """The inbox refuses a blob whose declared size is over blob_cap from its first chunk (counter
    oversize; tests/faults/test_faults_hostile.py sends them over a real broker)."""
    assert _ctx().blob_cap == payload_bound(SHAPES) + 8192 < 10_000


def test_weight_is_capped_at_max_samples() -> None:
    up = Update({"b": TensorDelta((4,), np.float32([0.1, 0.2, 0.3, 0.4]))}, 2**32 - 1)
    v = validate("dev-1", encode_update(up, UpdateHeader("fed", 2, "dev-1", BASE)), _ctx(max_samples=500))
    assert v.accepted and v.weight == 500.0


def test_norm_history_bound_rules() -> None:
    g = {"w": torch.full((4,), 2.0)}  # norm 4
    assert NormHistory(0.0, 5, 2).bound(None, g) is None  # norm_auto = 0: no bound
    h = NormHistory(10.0, 5, 2)
    assert h.bound(7.0, g) == 7.0  # explicit wins
    assert h.bound(None, g) == pytest.approx(40.0)  # warm-up: 10 x the model's norm
    h.add([1.0, float("nan")])
    assert h.bound(None, g) == pytest.approx(40.0)  # one finite norm < warm-up of 2 (its median rule: 10)
    h.add([3.0])
    assert h.bound(None, g) == pytest.approx(20.0)  # warmed up: 10 x median(1, 3), no longer the model's norm
    h.add([2.0, 100.0, 6.0, 7.0])
    assert h.norms == [3.0, 2.0, 100.0, 6.0, 7.0]  # the window keeps the last 5
    # 10 x median(2, 3, 6, 7, 100); the warm-up rule gives 40, a median over all six norms 45, the mean 236
    assert h.bound(None, g) == pytest.approx(60.0)
    assert state_norm(g) == pytest.approx(4.0)


@dataclass
class _Msg:
    topic: str
    payload: bytes


def test_receive_queue_bounds_each_sender_and_serves_them_in_turn() -> None:
    q = ReceiveQueue(max_bytes=10_000, max_sender_bytes=3_000)
    flood = [q.put(_Msg("fl/f/update/evil/1/0", b"x" * 1000)) for _ in range(10)]
    assert flood.count(True) == 2 and q.take_dropped() == {"evil": 8}  # 2 x (1000 + topic + overhead) fit
    assert q.put(_Msg("fl/f/update/good/1/0", b"y" * 1000)) and q.put(_Msg("fl/f/status/good", b"s"))
    q.put("connected")  # a control event: never dropped, served first
    assert q.get(0.1) == "connected"
    order = [sender_of(q.get(0.1).topic) for _ in range(4)]
    assert order == ["evil", "good", "evil", "good"] and q.get(0.01) is None and q.bytes == 0
    assert q.peak_bytes <= 10_000
    big = ReceiveQueue(max_bytes=2_500, max_sender_bytes=2_500)
    assert big.put(_Msg("fl/f/update/a/1/0", b"x" * 2000)) and not big.put(_Msg("fl/f/update/b/1/0", b"x" * 2000))
    assert big.take_dropped() == {"b": 1}


def test_quarantine_survives_a_restart_and_finite_fold_leaves_the_poison_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    q = Quarantine(tmp_path)
    q.add(3, "dev-x", "ab" * 32, "test")
    assert (3, "dev-x", "ab" * 32) in Quarantine(tmp_path)
    g = {"w": torch.tensor([3e38, 0.0])}
    ups = {"good": Update({"w": TensorDelta((2,), np.float32([1.0, 1.0]))}, 10),
           "bad": Update({"w": TensorDelta((2,), np.float32([3e38, 0.0]))}, 10)}
    agg, left = finite_fold(lambda: make_aggregator(g), [(k, lambda a, u=u: a.fold(u)) for k, u in ups.items()])
    assert left == ["bad"] and agg.contributors == 1 and bool(torch.isfinite(agg.result()["w"]).all())


def test_refusals_between_rounds_go_into_the_next_rounds_metrics() -> None:
    from collections import Counter
    from types import SimpleNamespace

    from coordinator.inbox import Inbox
    from coordinator.metrics import RoundStats

    counters: Counter[str] = Counter()
    inbox = Inbox(None, None, "coord", None, SimpleNamespace(max_pending_bytes=1 << 20), counters)  # type: ignore[arg-type]
    inbox.count("duplicate", "dev-b round 1: already folded", "dev-b")  # no round open: between rounds
    inbox.count("cut_off", "", "dev-c", n=3, quiet=True)
    stats = RoundStats(round=2, selected=["dev-a"], opened_at=0.0)
    inbox.open = SimpleNamespace(stats=stats)  # type: ignore[assignment]
    assert dict(stats.rejected) == {"duplicate": 1, "cut_off": 3} == dict(counters)
    assert stats.refusals == [{"reason": "duplicate", "detail": "dev-b round 1: already folded", "device": "dev-b"}]
    inbox.count("late", "dev-c round 1: round 1 is closed", "dev-c")
    assert stats.rejected["late"] == 1 and not inbox._between  # counted once, in the open round
