"""A secure round's provisional booking (edge_client.booking): final at the unmask answer, taken back only for a
round whose sum cannot hold the device's input."""

from __future__ import annotations

import pytest

from edge_client import booking
from edge_client.budget import LEDGER_KEY, DeviceLedger



def _booked(extra: dict, privacy: dict, round_: int, session: str) -> None:
    from flayer.engine.privacy import RoundPrivacy

    from edge_client.budget import contribution_multiplier

    before = DeviceLedger.from_extra(extra).rounds
    ledger = DeviceLedger.from_extra(extra)
    rp = RoundPrivacy.from_plan(privacy)
    assert rp is not None
    ledger.record(contribution_multiplier(rp, True), round_)
    extra[LEDGER_KEY] = ledger.state()
    booking.mark_pending(extra, privacy, round_, session, before)


def _privacy() -> dict:
    from flayer.engine.privacy import RoundPrivacy
    from flayer.privacy_config import PrivacySettings

    s = PrivacySettings(enabled=True, mode="local", clip=1.0, noise_multiplier=1.0, secure_aggregation=True,
                        population=100).resolve(100, 3)
    return RoundPrivacy.of(s, 1.0).as_plan()


def test_a_booking_is_final_at_the_unmask_answer_and_taken_back_only_when_void() -> None:
    privacy, extra = _privacy(), {}
    _booked(extra, privacy, 1, "fed.1.aa")
    assert booking.pending(extra)[:2] == (1, "fed.1.aa")
    assert booking.settle(extra, 1, "fed.1.aa", revealed=True) and booking.pending(extra) is None
    assert DeviceLedger.from_extra(extra).rounds == 1
    _booked(extra, privacy, 2, "fed.2.bb")
    assert not booking.settle(extra, 2, "fed.2.other", revealed=False)  # another session: nothing moves
    assert booking.settle(extra, 2, "fed.2.bb", revealed=False)
    ledger = DeviceLedger.from_extra(extra)
    assert ledger.rounds == 1 and ledger.last_round == 2  # taken back, and never booked twice
    _booked(extra, privacy, 2, "fed.2.bb")  # a re-sent masked input of the same round books nothing
    assert DeviceLedger.from_extra(extra).rounds == 1 and booking.pending(extra) is None


def test_the_plans_void_list_is_checked() -> None:
    assert booking.void_sessions(None) == frozenset() and booking.void_sessions("") == frozenset()
    assert booking.void_sessions("fed.1.aa fed.2.bb") == {"fed.1.aa", "fed.2.bb"}
    for bad in (["fed.1.aa"], "x" * 300, 7):
        with pytest.raises(ValueError, match="secure.void"):
            booking.void_sessions(bad)


def test_a_round_taken_back_frees_its_schema_slot_and_k_contributions_still_stop_the_device() -> None:
    """max_participations 1 pinned: a round voided after its masked input left frees the device's one slot (as the
    coordinator's rule does); once one round is final the device refuses the next by its own ledger."""
    from edge_client.budget import schema_problem
    from flayer.privacy_config import ParticipationSchema

    pinned = ParticipationSchema(1, 0)
    privacy, extra = {**_privacy(), **pinned.as_plan()}, {}

    def problem(round_: int) -> str | None:
        ledger = DeviceLedger.from_extra(extra)
        return schema_problem(privacy, pinned, ledger.rounds, ledger.last_round, round_)

    _booked(extra, privacy, 1, "fed.1.aa")
    assert problem(2) is not None  # provisional: counted
    assert booking.settle(extra, 1, "fed.1.aa", revealed=False)  # the round named void
    assert problem(2) is None
    _booked(extra, privacy, 2, "fed.2.bb")
    assert booking.settle(extra, 2, "fed.2.bb", revealed=True)
    assert "max_participations" in (problem(3) or "")
