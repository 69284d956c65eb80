"""When a secure round's contribution stays in a device's ledger (docs/explanation/secure-aggregation.md, "When a
device books a secure round").

A device books a private secure round in its ledger (:mod:`edge_client.budget`) before its masked input leaves, and
marks that entry **provisional** in the same state file (``extra["dp_secure_pending"]``: round, session, z). It becomes
final when the device answers the round's unmask request -- the point its input can be revealed in the sum -- and the
state file saying so is written before the answer leaves. It is **taken back** (the ledger as if the round had not
been booked) only when a later plan names the round's session as abandoned before any unmask request went out (the
plan's ``secure.void``: the sessions, space-separated; the coordinator's word).

A device that signs a survivor set leaving it out (a witness: :attr:`flayer.secagg.SecAggClient.left_out`) before its
masked input left sends nothing more and has booked nothing. Once its masked input has left, such a set does **not**
take the booking back: the consistency round binds only the devices that answer the unmasking, so the coordinator may
show this device a set without it, show every other device the set with it (T signatures without this one) and
unmask the sum with its input (its neighbours reveal shares of its self-mask seed).

Anything else -- the device crashed or went offline after its masked input, the round was abandoned during the
unmasking, or the device never heard -- keeps the booking: a ledger may count a round whose sum was not revealed,
never miss one whose sum was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

from flayer.engine.privacy import RoundPrivacy

from .budget import LEDGER_KEY, DeviceLedger, contribution_multiplier

__all__ = ["PENDING_KEY", "mark_pending", "pending", "settle", "void_sessions"]

log = logging.getLogger("edge_client.client")

PENDING_KEY = "dp_secure_pending"


def pending(extra: Mapping[str, Any]) -> tuple[int, str, float] | None:
    """The provisional booking in a state file's ``extra`` (None: none, or malformed: then it stays booked)."""
    raw = extra.get(PENDING_KEY)
    try:
        return (int(raw["round"]), str(raw["session"]), float(raw["z"])) if raw else None
    except (KeyError, TypeError, ValueError):
        return None


def mark_pending(extra: MutableMapping[str, Any], privacy: Mapping[str, Any], round_: int, session: str,
                 rounds_before: int) -> None:
    """Mark the booking just made for ``round_`` provisional (only when the ledger did count it: a re-sent masked
    input books nothing new)."""
    rp = RoundPrivacy.from_plan(privacy) if privacy else None
    try:
        booked = DeviceLedger.from_extra(extra).rounds > rounds_before
    except ValueError:
        booked = False
    if rp is None or not booked:
        return
    extra[PENDING_KEY] = {"round": int(round_), "session": str(session), "z": contribution_multiplier(rp, True)}


def settle(extra: MutableMapping[str, Any], round_: int, session: str, revealed: bool) -> bool:
    """Make the provisional booking of (``round_``, ``session``) final (``revealed``) or take it back; True when
    ``extra`` changed (the caller writes the state file before it answers)."""
    mine = pending(extra)
    if mine is None or mine[:2] != (round_, session):
        return False
    del extra[PENDING_KEY]
    if revealed:
        return True
    try:
        ledger = DeviceLedger.from_extra(extra)
    except ValueError:
        return True  # a malformed ledger is replaced at the next booking (edge_client.budget)
    z = mine[2]
    if ledger.last_round == round_ and ledger.runs and ledger.runs[-1][0] == z:
        last_z, n = ledger.runs[-1]
        ledger.runs = ledger.runs[:-1] + ([(last_z, n - 1)] if n > 1 else [])
        extra[LEDGER_KEY] = ledger.state()  # last_round stays: the round is never booked twice
        log.info("secure round %d: its contribution is taken back from the ledger (its sum cannot be revealed)",
                 round_)
    return True


def void_sessions(raw: Any) -> frozenset[str]:
    """The sessions a plan's ``secure.void`` names (space-separated); ValueError when malformed."""
    if raw is None or raw == "":
        return frozenset()
    if not isinstance(raw, str) or len(raw) > 256:
        raise ValueError("plan: secure.void must be a string of at most 256 characters (space-separated sessions)")
    return frozenset(raw.split())
