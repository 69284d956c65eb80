"""While the masked inputs' stage is held past quorum and grace, the coordinator must not recompute the outlook on
every tick (commit ea41fc8 and flayer.secagg.outlook.Outlook: "an answer is kept while the members, the complaints
and the named devices stay the same", "computed once per change of its members, complaints or named devices ...,
not on every coordinator tick: 2.7 ms a computation at n = 1,000, k = 38").

The adversary: one selected device and 19 of its neighbours (k = 38, t = 20 at n = 1,000), colluding. Each
advertises and shares honestly, stays online and never sends its masked input -- a dropout, no fault, nothing named.
When quorum and grace come, the devices in hold 19 shares of the first one's mask key, so the coordinator holds the
stage open for the silent ones (SecureRound.held) until the round's deadline. Then every event the coordinator's
worker takes (any message of any device, a status, a refused message: coordinator.server.Coordinator.run ticks
after each) runs coordinator.secure_phase.SecurePhase.tick twice -- SecureRound.advance (the largest set that can
come) and SecureRound.held (the set in, then the largest set) -- and the outlook's one cached answer alternates
between two keys, so each tick recomputes it twice: measured 101 computations in 50 unchanged ticks, 3.2 ms CPU a
tick at n = 1,000 (a refused message's own cost is its signature check, about 0.12 ms: docs/results/signing.md).

Built from the protocol state the coordinator would hold (who sealed shares for whom, who masked), not from
sealed shares: the outlook reads only the receivers of each share batch. Found by a red team on the first cache (one
answer); now the outlook keeps four answers by key (2 computations in 50 unchanged ticks, 0.34 ms a tick).
"""

from __future__ import annotations

import types

import numpy as np
import pytest


def test_a_held_stage_does_not_recompute_the_outlook_on_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    import flayer.secagg.outlook as outlook
    from coordinator.secure_round import SecureRound
    from flayer.engine.secure import PlannedSecure, round_params
    from flayer.engine.secure_layout import layout_of
    from flayer.privacy_config import PrivacySettings
    from flayer.update import TensorDelta, Update

    names = tuple(f"dev-{i:04d}" for i in range(1000))
    up = Update({"w": TensorDelta((8,), np.zeros(3, np.float32), np.array([1, 4, 6]))}, 10)
    lay = layout_of(up)
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, names, lay, 0)
    assert (params.degree, params.threshold) == (38, 20)
    sec = SecureRound(PlannedSecure(params, lay.digest, False, 5.0), lay, stage_end=105.0)
    s = sec.server
    # every device advertised and shared; the stage of the masked inputs is open
    s._adverts = {d: None for d in names}
    s._sent = {d: tuple(types.SimpleNamespace(receiver=r) for r in params.neighbours(d)) for d in names}
    s._stage, sec.stage = 3, 3
    lead = names[0]  # the colluders: lead and 19 of its neighbours, online, silent
    silent = {lead} | set(sorted(params.neighbours(lead))[:params.degree - params.threshold + 1])
    s._masked = set(names) - silent  # every honest masked input is in: quorum and grace have passed

    calls = [0]
    real = outlook.shortfall

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(outlook, "shortfall", counted)
    for _ in range(20):  # an event each: the coordinator's tick in the held stage (SecurePhase.tick, twice)
        assert sec.advance(102.0) == [] and sec.stage == 3
        held = sec.held()
        assert held is not None and f"s_{lead}" in held, held
    assert calls[0] <= 3, (f"{calls[0]} outlook computations in 20 ticks with nothing changed: the cached answer is "
                           "recomputed on every tick while the stage is held")
