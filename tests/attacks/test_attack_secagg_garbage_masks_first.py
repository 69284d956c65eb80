"""A hostile device that seals every neighbour garbage and sends its masked input FIRST (before its victims'
complaints arrive) must not get an honest secure round ended at once (docs/explanation/secure-aggregation.md,
"Faults named and left out": "A device that sealed garbage to all its neighbours no longer costs the round it is
named in either: its neighbours remove its pairwise masks with their own pair seeds"; "The shares each device could
reveal": a round ends at once only when "every reachable survivor set falls short").

The adversary is one selected device with its own keys: it advertises honestly, seals every neighbour a share that
opens to no share at the receiver's x (signed, under the pair's genuine key: test_attack_secagg_garbage_outlook's
move), and masks as soon as its shares are routed -- it files no complaint, so nothing delays its masked input, while
each honest device first opens its shares and complains. Its masked input is in before it is named; the coordinator
names it at the first complaint. A survivor set without it is reachable by the protocol's own means (the consent
stage takes a masked input without a consent back out of the sum: flayer.secagg.server_consent), and there every
honest neighbour reveals its pair seed toward it (the garbage sealer's route) -- four honest survivors, t = 3: the
round can be unmasked. Found by a red team: on the code before, the outlook counted the dealer's b as needed (it
stayed in the sum), found no honest holder of it, and ended the honest round at once. Now a device named faulty is
never asked for its consent (one it sends is refused), so its masked input is taken back out and it counts as dropped.
"""

from __future__ import annotations

import numpy as np
import pytest
from attacklib_secagg import coordinator_round, send_masked, spoil_shares, to_shares, unmask_all

HONEST = ("dev-0", "dev-1", "dev-2", "dev-3")


def test_a_dealer_masking_before_its_victims_complain_does_not_end_an_unmaskable_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flayer.engine.secure import device_vector
    from flayer.secagg import SecAggAbandoned

    spoil_shares(monkeypatch, "evil", lambda c: set(c._peers))
    sec, clients, ups = coordinator_round((*HONEST, "evil"))
    p = sec.planned.params
    routed = to_shares(sec, clients)
    # evil masks at once: no complaint of its own to send first
    masked = clients["evil"].masked_input(routed["evil"], device_vector(ups["evil"], sec.layout, p,
                                                                        np.random.default_rng(0)))
    assert sec.masked("evil", masked.to_bytes()) is None
    for d in HONEST:  # each honest device: its complaint of evil, then its masked input (an edge client's order)
        assert send_masked(sec, clients, ups, routed, d) is None, d
        try:
            assert sec.advance(102.0) == [] and sec.stage == 3
        except SecAggAbandoned as exc:
            pytest.fail(f"after {d}'s complaint and masked input, an honest round that can be unmasked without the "
                        f"named dealer (4 honest survivors, t={p.threshold}) was ended at once: {exc}")
    assert set(sec.server.faulty) == {"evil"}
    try:
        out = unmask_all(sec, clients)
    except SecAggAbandoned as exc:
        pytest.fail(f"the honest round was abandoned: {exc}")
    assert out.reason is None and out.update is not None, out.reason
    assert "evil" not in out.survivors
