"""Every way an update blob is accepted or refused, on real encoded blobs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from coordinator.intake import IntakeContext, screen, validate
from flayer.aggregate import check_update
from flayer.engine import Bounds, VersionWindow, scale_update
from flayer.update import TensorDelta, Update
from protocol import UpdateHeader, WireLimits, encode_update

SHAPES = {"w": (4, 3), "b": (4,)}
BASE = "ab" * 32


def _update(scale: float = 0.1, shape: tuple[int, ...] = (4, 3)) -> Update:
    rng = np.random.default_rng(0)
    return Update({"w": TensorDelta(shape, (rng.standard_normal(int(np.prod(shape))) * scale).astype(np.float32)),
                   "b": TensorDelta((4,), np.float32([1, 2]) * scale, np.array([0, 3]))}, 10, {"test_correct": 3.0})


def _blob(update: Update | None = None, sender: str = "dev-1", round_: int = 2, base: str = BASE,
          federation: str = "fed") -> bytes:
    return encode_update(update or _update(), UpdateHeader(federation, round_, sender, base))


def _ctx(norm_bound: float | None = None, norm_policy: str = "reject", **kw: object) -> IntakeContext:
    args: dict[str, object] = dict(federation="fed", round=2, bases={2: BASE}, shapes=SHAPES, limits=WireLimits(),
                                   max_update_bytes=1 << 20, bounds=Bounds(norm_bound, norm_policy))
    args.update(kw)
    return IntakeContext(**args)  # type: ignore[arg-type]


def test_accepts_a_good_update() -> None:
    v = validate("dev-1", _blob(), _ctx())
    assert v.accepted and v.counter is None and v.update is not None
    assert v.norm == pytest.approx(check_update(_update(), SHAPES))
    np.testing.assert_array_equal(v.update.deltas["w"].values, _update().deltas["w"].values)


@pytest.mark.parametrize("blob, ctx_kw, counter, words", [
    (b"garbage" * 10, {}, "malformed", "magic"),
    (_blob()[:-3], {}, "malformed", ""),
    (_blob(federation="other"), {}, "malformed", "federation"),
    (_blob(round_=3), {}, "malformed", "round"),
    (_blob(sender="dev-2"), {}, "wrong_sender", "dev-2"),
    (_blob(base="cd" * 32), {}, "wrong_model", "model"),
    (_blob(_update(shape=(3, 4))), {}, "malformed", "shape"),
    (_blob(_update(scale=100.0)), {"norm_bound": 5.0}, "norm", "norm"),
])
def test_refusals_name_a_counter_and_a_reason(blob: bytes, ctx_kw: dict, counter: str, words: str) -> None:
    v = validate("dev-1", blob, _ctx(**ctx_kw))
    assert v.status == "rejected" and v.counter == counter and not v.accepted
    assert words in v.reason and v.reason


def test_invalid_positions_and_sample_counts_via_check_update() -> None:
    bad = Update({"b": TensorDelta((4,), np.float32([1.0]), np.array([2]))}, 10)
    ok = validate("dev-1", _blob(bad), _ctx())
    assert ok.accepted  # a sparse subset is fine
    v = validate("dev-1", _blob(bad), _ctx(shapes={"w": (4, 3)}))
    assert v.counter == "malformed" and "not part of the global model" in v.reason


def test_clip_policy_scales_to_the_bound() -> None:
    v = validate("dev-1", _blob(_update(scale=100.0)), _ctx(norm_bound=5.0, norm_policy="clip"))
    assert v.accepted and v.clipped and v.update is not None
    assert check_update(v.update, SHAPES) == pytest.approx(5.0, rel=1e-5)
    assert check_update(v.update, SHAPES) <= 5.0
    halved = scale_update(_update(), 0.5)
    np.testing.assert_allclose(halved.deltas["w"].values, _update().deltas["w"].values * 0.5)


def test_screen() -> None:
    sel, acc, before = frozenset({"a", "b"}), {"a"}, {1: {"c"}}
    assert screen("b", 2, 2, 1, sel, acc, before) is None
    assert screen("a", 2, 2, 1, sel, acc, before).counter == "duplicate"  # type: ignore[union-attr]
    assert screen("z", 2, 2, 1, sel, acc, before).status == "not_selected"  # type: ignore[union-attr]
    v = screen("b", 1, 2, 1, sel, acc, before)
    assert v is not None and v.status == "late" and "round 1 is closed" in v.reason
    assert screen("c", 1, 2, 1, sel, acc, before).status == "duplicate"  # type: ignore[union-attr]
    assert screen("b", 3, 2, 1, sel, acc, before).counter == "future_round"  # type: ignore[union-attr]
    assert screen("b", 2, None, 1, sel, acc, before).counter == "future_round"  # type: ignore[union-attr]
    assert screen("b", 1, None, 1, sel, acc, before).status == "late"  # type: ignore[union-attr]


def test_the_declared_size_cap_is_the_smaller_of_the_setting_and_what_the_model_holds() -> None:
    assert _ctx(max_update_bytes=50).blob_cap == 50
    assert _ctx(payload_cap=1000).blob_cap == 1000 + 8192


def test_async_screen_takes_older_versions_within_max_staleness() -> None:
    w = VersionWindow(max_staleness=2)
    for v in (1, 2, 3, 4):
        w.publish(v, f"{v:02x}" * 32)
        w.offer({"a"} if v < 4 else {"b"})
    assert screen("a", 3, 4, 3, frozenset(), set(), {}, w) is None  # staleness 1
    assert screen("a", 2, 4, 3, frozenset(), set(), {}, w) is None  # staleness 2 = max_staleness
    v = screen("a", 1, 4, 3, frozenset(), set(), {}, w)
    assert v is not None and v.counter == "stale" and v.status == "late" and "max_staleness" in v.reason
    assert screen("a", 4, 4, 3, frozenset(), set(), {}, w).counter == "not_selected"  # type: ignore[union-attr]
    assert screen("b", 5, 4, 3, frozenset(), set(), {}, w).counter == "future_round"  # type: ignore[union-attr]
    w.fold("a", 3)
    assert screen("a", 3, 4, 3, frozenset(), set(), {}, w).counter == "duplicate"  # type: ignore[union-attr]


def test_async_validate_checks_the_base_of_the_round_it_names_and_weights_staleness() -> None:
    ctx = _ctx(round=4, bases={1: "ab" * 32, 2: BASE, 3: "cd" * 32, 4: "ef" * 32}, bounds=Bounds(max_staleness=2))
    fresh = validate("dev-1", _blob(round_=4, base="ef" * 32), ctx, 4)
    stale = validate("dev-1", _blob(round_=2), ctx, 2)
    assert fresh.accepted and stale.accepted and stale.staleness == 2 and fresh.staleness == 0
    assert stale.update is not None and fresh.update is not None
    np.testing.assert_allclose(stale.update.deltas["w"].values, fresh.update.deltas["w"].values / np.sqrt(3),
                               rtol=1e-6)
    assert validate("dev-1", _blob(round_=3), ctx, 3).counter == "wrong_model"
    assert validate("dev-1", _blob(round_=1, base="ab" * 32), ctx, 1).counter == "stale"
    # the staleness is the header's: an old update under a newer round's topic is malformed, not fresh
    v = validate("dev-1", _blob(round_=2), ctx, 4)
    assert v.counter == "malformed" and "expected 'fed' round 4" in v.reason


def test_close_by_follows_the_recent_rounds() -> None:
    from types import SimpleNamespace

    from coordinator.state import Progress

    p = Progress(None, {})  # type: ignore[arg-type]  # close_by reads the durations alone
    fs: Any = SimpleNamespace(mode="sync", staleness_bound=0)
    assert p.close_by(fs, 100.0, 160.0, False) == 0.0  # no history: devices use the deadline
    p.durations = [12.0, 10.0, 30.0]
    assert p.close_by(fs, 100.0, 160.0, False) == 110.0  # the shortest recent round after the open (not the median, 12)
    assert p.close_by(fs, 100.0, 105.0, False) == 105.0  # never past the deadline
    fs = SimpleNamespace(mode="async", staleness_bound=4)
    assert p.close_by(fs, 100.0, 160.0, False) == 100.0 + 12.0 * 2  # two versions of the median length (ASYNC_AIM_VERSIONS)
    assert p.close_by(fs, 100.0, 160.0, True) == 100.0 + 12.0  # the run's last version: its own close
