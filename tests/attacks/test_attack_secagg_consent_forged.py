"""Honest neighbours reveal no share of a device's self-mask seed b_u without u's own consent
(docs/explanation/secure-aggregation.md, "The consent stage"; docs/explanation/guarantees.md).

The adversary is the coordinator: it routes every message, so it holds every consent the devices gave it (of this
round and of earlier ones) and can put any bytes in an unmask request. The victim u sent its masked input and never
consented (it was never asked, or went away before). The coordinator keeps u in the survivor set, gathers T honest
signatures over that set, and asks each of u's neighbours for its share of b_u with u's consent absent, made up,
taken from another round, given by another device, or given under another plan. Each honest neighbour -- a real
:class:`~flayer.secagg.SecAggClient` with its long-term key -- refuses the whole request, naming why, and reveals
nothing; with u's genuine consent the same request is answered. On the code before there was no consent: each
neighbour revealed its share of b_u for any device the request listed as a survivor.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from attacklib_secagg import honest_to_masked

from flayer.secagg import (
    ConsentRequest,
    ConsistencyRequest,
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    UnmaskRequest,
)
from flayer.secagg.consistency import survivor_set_message

IDS = tuple(f"dev-{i:02d}" for i in range(6))
VICTIM = IDS[0]
N = 16


def _params(round_id: int = 1, context: bytes = b"") -> SecAggParams:
    p = SecAggParams("fed.1.ab", round_id, IDS, 4, 5, bytes(32), N, RingSpec.for_summands(1.0, len(IDS)))
    return dataclasses.replace(p, context=context) if context else p


def _to_unmask(params: SecAggParams, who: LocalIdentities):  # type: ignore[no-untyped-def]
    """Every device through its masked input; all but the victim consent; all sign the set holding the victim."""
    clients = {d: SecAggClient(params, d, SeededEntropy(d.encode().ljust(32, b"\0")), who.for_device(d)) for d in IDS}
    honest_to_masked(SecAggServer(params), clients, {d: np.full(N, 1, np.uint32) for d in IDS})
    consents = {d: clients[d].consent(ConsentRequest(params.round, d)).signature for d in IDS if d != VICTIM}
    everyone = tuple(sorted(IDS))
    sigs = {}
    for d in IDS[1:]:
        sigs[d] = clients[d].sign_survivors(ConsistencyRequest(params.round, d, everyone)).signature
    return clients, consents, sigs


def _request(params: SecAggParams, d: str, consents: dict[str, bytes], sigs: dict[str, bytes],
             victim_consent: bytes | None) -> UnmaskRequest:
    listed = tuple([d] + [v for v in sorted(IDS) if v != d])  # complete graph: every other device is a neighbour
    given = dict(consents)
    if victim_consent is not None:
        given[VICTIM] = victim_consent
    return UnmaskRequest(params.round, d, len(IDS), listed, (), tuple((s, g) for s, g in sorted(sigs.items()) if s != d),
                         consents=tuple((v, given[v]) for v in listed if v in given))


def _forgeries() -> dict[str, bytes | None]:
    """The victim's consent as the coordinator can make it up (each key: how it was made)."""
    who = LocalIdentities(IDS, SeededEntropy(b"consent forged!!" * 2))
    from flayer.secagg.msg_consent import consent_message

    here = _params()
    other_round = _params(2)
    other_plan = _params(context=b"\x01" * 32)
    return {
        "absent": None,
        "made up": bytes(64),
        "another round": who.signer(VICTIM)(consent_message(here.session, 2, VICTIM, other_round.transcript)),
        "another plan": who.signer(VICTIM)(consent_message(here.session, 1, VICTIM, other_plan.transcript)),
        "another device": who.signer(IDS[1])(consent_message(here.session, 1, IDS[1], here.transcript)),
        "another purpose": who.signer(VICTIM)(survivor_set_message(here.session, 1, IDS, here.transcript)),
    }


@pytest.mark.parametrize("how", list(_forgeries()))
def test_no_neighbour_reveals_a_share_of_b_u_without_the_victims_own_consent(how: str) -> None:
    who = LocalIdentities(IDS, SeededEntropy(b"consent forged!!" * 2))  # the same keys the forgeries were made with
    params = _params()
    clients, consents, sigs = _to_unmask(params, who)
    forged = _forgeries()[how]
    for d in IDS[1:]:  # every neighbour of the victim (complete graph)
        with pytest.raises(SecAggError, match=f"{VICTIM} as a survivor without its consent" if forged is None
                           else f"consent the unmask request carries for {VICTIM} does not verify"):
            clients[d].unmask(_request(params, d, consents, sigs, forged))
        with pytest.raises(SecAggError, match="refused an earlier message"):  # nothing revealed after, either
            clients[d].unmask(_request(params, d, consents, sigs, forged))


def test_with_the_victims_genuine_consent_the_same_request_is_answered() -> None:
    """The control: the refusals above are the consent's doing (here the victim consented)."""
    who = LocalIdentities(IDS, SeededEntropy(b"consent forged!!" * 2))
    params = _params()
    clients, consents, sigs = _to_unmask(params, who)
    genuine = clients[VICTIM].consent(ConsentRequest(params.round, VICTIM)).signature
    answer = clients[IDS[1]].unmask(_request(params, IDS[1], consents, sigs, genuine))
    assert VICTIM in dict(answer.b_shares)


def test_a_device_that_sent_no_masked_input_refuses_to_consent() -> None:
    who = LocalIdentities(IDS, SeededEntropy(b"consent forged!!" * 2))
    params = _params()
    late = SecAggClient(params, VICTIM, SeededEntropy(bytes(32)), who.for_device(VICTIM))
    late.advertise()
    with pytest.raises(SecAggError, match="consent out of order"):
        late.consent(ConsentRequest(params.round, VICTIM))
