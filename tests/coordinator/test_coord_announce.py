"""The close rule's wait for announced uploads (coordinator.rounds, Announcements): what is taken, what
is ignored, and the bound that holds whatever a device announces."""

from __future__ import annotations

import math

import pytest

from coordinator.rounds import ANNOUNCE_EXTRA_S, ANNOUNCE_SLACK, Announcements, RoundTimer


def _timer(wait: float = 10.0) -> tuple[RoundTimer, Announcements, set[str]]:
    arrived: set[str] = set()
    ann = Announcements(3, frozenset({"a", "b", "c"}))
    t = RoundTimer(0.0, 60.0, 3, 2, 3.0, announce_wait_s=wait, announced=ann, arrived=arrived)
    return t, ann, arrived


@pytest.mark.parametrize(("client", "info", "why"), [
    ("z", {"upload_round": 3, "upload_s": 1.0}, "not selected"),
    ("a", {"upload_round": 2, "upload_s": 1.0}, "round 2"),
    ("a", {"upload_round": True, "upload_s": 1.0}, "round True"),
    ("a", {"upload_round": 3, "upload_s": math.nan}, "finite"),
    ("a", {"upload_round": 3, "upload_s": -1.0}, "finite"),
    ("a", {"upload_round": 3, "upload_s": "5"}, "finite"),
    ("a", {"upload_round": 3, "upload_s": True}, "finite"),
    ("a", {"state": "x"}, "no announcement"),
])
def test_bad_announcements_are_ignored(client: str, info: dict, why: str) -> None:
    _, ann, arrived = _timer()
    assert why in ann.add(client, info, 1.0, arrived)
    assert ann.finish == {}


def test_only_the_first_announcement_counts_and_none_after_arrival() -> None:
    _, ann, arrived = _timer()
    assert ann.add("a", {"upload_round": 3, "upload_s": 2.0}, 1.0, arrived) == ""
    assert "already" in ann.add("a", {"upload_round": 3, "upload_s": 50.0}, 2.0, arrived)
    assert ann.finish["a"] == 1.0 + 2.0 * ANNOUNCE_SLACK + ANNOUNCE_EXTRA_S
    arrived.add("b")
    assert "already in" in ann.add("b", {"upload_round": 3, "upload_s": 2.0}, 2.0, arrived)


def test_the_close_waits_for_an_announced_upload_until_it_arrives() -> None:
    t, ann, arrived = _timer()
    ann.add("c", {"upload_round": 3, "upload_s": 4.0}, 2.0, arrived)  # expected by 2 + 6 + 2 = 10
    arrived.update({"a", "b"})
    t.accepted(2, 4.0)  # quorum at 4: plain close at 7
    assert t.decide(2, 7.5).action == "wait" and t.next_wakeup(7.5) == 10.0
    arrived.add("c")
    assert t.decide(3, 7.6).action == "close"  # every selected device in


@pytest.mark.parametrize("secs", [0.0, 1e9])
def test_the_bound_holds_whatever_is_announced(secs: float) -> None:
    """0: no rate known (awaited to the bound); 1e9: an endless upload claimed."""
    t, ann, arrived = _timer(wait=5.0)
    ann.add("c", {"upload_round": 3, "upload_s": secs}, 1.0, arrived)
    arrived.update({"a", "b"})
    t.accepted(2, 4.0)
    assert t.decide(2, 11.9).action == "wait" and t.next_wakeup(11.9) == 12.0  # 4 + 3 grace + 5
    d = t.decide(2, 12.0)
    assert d.action == "close" and "announced" in d.reason


def test_no_wait_when_off_or_nothing_announced() -> None:
    t, ann, arrived = _timer(wait=0.0)
    ann.add("c", {"upload_round": 3, "upload_s": 4.0}, 2.0, arrived)
    t.accepted(2, 4.0)
    assert t.decide(2, 7.0).action == "close"
    t2, _, _ = _timer()
    t2.accepted(2, 4.0)
    assert t2.decide(2, 7.0).reason == "quorum 2 + grace 3s"
