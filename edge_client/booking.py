"""When a secure round's contribution enters a device's ledger (docs/explanation/secure-aggregation.md, "When a
device books a secure round").

A device books a private secure round in its ledger (:mod:`edge_client.budget`) **at its consent**: the coordinator
asks each device whose masked input it holds for its consent (:mod:`flayer.secagg.msg_consent`), and the device
writes the round into its ledger, in its state file, before the consent leaves. The booking is final: the device
needs nothing later (no unmask request, no word of the coordinator) to settle it.

Why this is sound against a coordinator that lies: a neighbour reveals its share of the device's self-mask seed b_u
only when the unmask request carries the device's consent and the neighbour verifies it under the device's own key
(:meth:`flayer.secagg.SecAggClient.unmask`), so the device's input can enter a revealed sum only after the device
booked it. A coordinator that skips the device's unmask request, or names the round void afterwards, holds no b_u
without the consent, and with it the round is in the ledger already.

What it costs: nothing before the consent -- a round abandoned before (too few keys, shares or masked inputs, the
coordinator gone, the device gone after its masked input) is not booked -- and the whole round after it, whether
or not the sum is then revealed: a round abandoned after the device consented stays in its ledger (over, never under).
A device that never sent its masked input refuses to consent; one that signed a survivor set leaving it out (a
witness) consents to nothing after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["PENDING_KEY", "book"]

log = logging.getLogger("edge_client.client")

PENDING_KEY = "dp_secure_pending"  # an earlier release's provisional booking: final as it stands (removed at the next)


def book(extra: MutableMapping[str, Any], record: Callable[[Mapping[str, Any], bool, int], None],
         privacy: Mapping[str, Any], round_: int) -> bool:
    """Book the secure round ``round_`` at its consent (``record``: the device's ledger writer,
    :meth:`edge_client.budget.DeviceBudgets._record_contribution`, which counts a round once); True when ``extra``
    changed and the caller writes the state file before the consent leaves. A round without privacy books nothing."""
    if not privacy:
        return False
    record(privacy, True, round_)
    extra.pop(PENDING_KEY, None)
    log.info("secure round %d: booked in the privacy ledger before its consent leaves", round_)
    return True
