"""Selection and the closing rules of a round, on a fake clock."""

from __future__ import annotations

import pytest

from coordinator.registry import DeviceRegistry
from coordinator.rounds import RoundTimer, select_devices
from protocol import Status

DEVICES = [f"dev-{i:02d}" for i in range(20)]


def test_over_selection_is_seeded_and_capped() -> None:
    a = select_devices(DEVICES, quorum=5, over_selection=1.3, seed=1, round_=4)
    assert len(a) == 7 and a == sorted(a) and set(a) <= set(DEVICES)
    assert a == select_devices(list(reversed(DEVICES)), 5, 1.3, 1, 4)  # order of the online list is irrelevant
    assert a != select_devices(DEVICES, 5, 1.3, 1, 5) or a != select_devices(DEVICES, 5, 1.3, 2, 4)
    assert select_devices(DEVICES[:3], quorum=5, over_selection=1.3, seed=1, round_=4) == DEVICES[:3]
    assert select_devices(DEVICES, quorum=4, over_selection=1.0, seed=0, round_=1).__len__() == 4
    rounds = [tuple(select_devices(DEVICES, 2, 1.0, 0, r)) for r in range(1, 30)]
    assert len(set(rounds)) > 10  # it actually varies per round


def _timer(**kw: float) -> RoundTimer:
    args = dict(opened_at=0.0, deadline=100.0, selected=4, quorum=3, grace_s=5.0, min_updates=2, extend_s=0.0)
    args.update(kw)
    return RoundTimer(**args)  # type: ignore[arg-type]


def test_everyone_reported_closes_at_once() -> None:
    t = _timer()
    for n in range(1, 5):
        t.accepted(n, float(n))
    assert t.decide(4, 4.0).action == "close"


def test_quorum_then_grace() -> None:
    t = _timer()
    t.accepted(1, 1.0)
    t.accepted(2, 2.0)
    assert t.quorum_at is None and t.decide(2, 50.0).action == "wait"
    t.accepted(3, 10.0)
    assert t.quorum_at == 10.0 and t.next_wakeup() == 15.0
    assert t.decide(3, 14.9).action == "wait"
    d = t.decide(3, 15.0)
    assert d.action == "close" and "quorum" in d.reason


def test_quorum_is_capped_by_the_selection() -> None:
    t = _timer(selected=2, quorum=5)
    t.accepted(1, 1.0)
    assert t.effective_quorum == 2 and t.quorum_at is None


@pytest.mark.parametrize("extend_s, count, first, second", [
    (0.0, 2, "close", None),  # enough at the deadline
    (0.0, 1, "close", None),  # too few, no extension configured: close with what arrived
    (30.0, 1, "extend", "close"),  # too few: extend once, then close anyway
    (30.0, 0, "extend", "close"),
])
def test_deadline(extend_s: float, count: int, first: str, second: str | None) -> None:
    t = _timer(extend_s=extend_s)
    assert t.decide(count, 99.9).action == "wait"
    d = t.decide(count, 100.0)
    assert d.action == first
    if second:
        t.extend()
        assert t.deadline == 130.0 and t.decide(count, 129.0).action == "wait"
        assert t.decide(count, 130.0).action == second


def test_registry_online_offline_stale_and_retained() -> None:
    reg = DeviceRegistry(stale_after_s=30.0)
    reg.observe("a", Status(0, "online", 1000.0), now=1000.0)
    reg.observe("b", Status(0, "training", 5.0), now=1000.0)  # device clock far behind: arrival counts
    reg.observe("c", Status(0, "online", 400.0), now=1000.0, retained=True)  # stored by the broker long ago
    reg.observe("d", Status(0, "offline", 1000.0), now=1000.0)
    assert reg.online(1000.0) == ["a", "b"]
    assert reg.online(1030.0) == ["a", "b"] and reg.online(1030.1) == []
    reg.observe("d", Status(1, "idle", 1031.0), now=1031.0)
    assert reg.online(1031.0) == ["d"] and len(reg) == 4
