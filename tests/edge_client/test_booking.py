"""A secure round's booking (edge_client.booking): final at the device's consent, nothing before it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_client import booking
from edge_client.budget import LEDGER_KEY, DeviceLedger, contribution_multiplier


def _recorder(extra: dict) -> Any:  # type: ignore[type-arg]
    """The ledger writer as the edge client's (DeviceBudgets._record_contribution) over ``extra``."""
    from flayer.engine.privacy import RoundPrivacy

    def record(privacy: Mapping[str, Any], secure: bool, round_: int) -> None:
        rp = RoundPrivacy.from_plan(privacy)
        assert rp is not None
        ledger = DeviceLedger.from_extra(extra)
        ledger.record(contribution_multiplier(rp, secure), round_)
        extra[LEDGER_KEY] = ledger.state()

    return record


def _privacy() -> dict:  # type: ignore[type-arg]
    from flayer.engine.privacy import RoundPrivacy
    from flayer.privacy_config import PrivacySettings

    s = PrivacySettings(enabled=True, mode="local", clip=1.0, noise_multiplier=1.0, secure_aggregation=True,
                        population=100).resolve(100, 3)
    return RoundPrivacy.of(s, 1.0).as_plan()


def test_a_round_is_booked_final_at_the_consent_once_and_an_earlier_provisional_mark_is_dropped() -> None:
    privacy = _privacy()
    extra: dict = {booking.PENDING_KEY: {"round": 1, "session": "fed.1.aa", "z": 1.0}}  # an earlier release's
    assert booking.book(extra, _recorder(extra), privacy, 2)
    ledger = DeviceLedger.from_extra(extra)
    assert ledger.rounds == 1 and ledger.last_round == 2 and booking.PENDING_KEY not in extra
    assert booking.book(extra, _recorder(extra), privacy, 2)  # asked again for the same round: counted once
    assert DeviceLedger.from_extra(extra).rounds == 1
    plain: dict = {}
    assert not booking.book(plain, _recorder(plain), {}, 3) and LEDGER_KEY not in plain  # no privacy: nothing


def test_k_contributions_counted_at_consent_stop_the_device() -> None:
    """max_participations 1 pinned: nothing is counted before the consent (a round abandoned before it leaves the
    slot free); once the device consented to one round it refuses the next by its own ledger."""
    from edge_client.budget import schema_problem
    from flayer.privacy_config import ParticipationSchema

    pinned = ParticipationSchema(1, 0)
    privacy, extra = {**_privacy(), **pinned.as_plan()}, {}

    def problem(round_: int) -> str | None:
        ledger = DeviceLedger.from_extra(extra)
        return schema_problem(privacy, pinned, ledger.rounds, ledger.last_round, round_)

    assert problem(2) is None  # round 1: its masked input left, no consent asked (abandoned): nothing counted
    assert booking.book(extra, _recorder(extra), privacy, 2)
    assert "max_participations" in (problem(3) or "")
