"""Bad keys and false shares from one device, in process (docs/explanation/secure-aggregation.md, "Faults named
and left out"; the same moves over a broker: test_attack_secagg_attribution.py, slow).

The adversary is one participant: it sends the coordinator a key advert of its choosing (an all-zero or other
low-order X25519 key, one key for both purposes, or an honest device's key), or -- having run the protocol
honestly -- a false share in its unmask answer. The guarantee: the advert is refused and its sender named, the
others' round is unmasked; the false share is caught and the sum is the honest one; a false share of its own seed
names its sender (one of a neighbour's seed cannot be told from a false dealing, and is skipped).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flayer.secagg import RingSpec, SecAggClient, SecAggError, SecAggParams, SecAggServer
from flayer.secagg.shamir import PRIME, decode_share, encode_share

IDS = tuple(f"dev-{i}" for i in range(6))
# a point of order 8 on Curve25519 (RFC 7748's list of low-order points, little-endian u)
ORDER_8 = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")


def _round() -> tuple[SecAggParams, SecAggServer, dict[str, SecAggClient]]:
    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    return params, SecAggServer(params), {d: SecAggClient(params, d) for d in IDS}


def _finish(server: SecAggServer, clients: dict[str, SecAggClient], devices: list[str],
            tamper: str | None = None, own: bool = True) -> np.ndarray:
    vectors = {d: np.full(8, i + 1, np.uint32) for i, d in enumerate(devices)}
    for d in devices:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    for d in devices:
        server.receive_masked(clients[d].masked_input(server.shares_for(d), vectors[d]))
    for d in devices:
        answer = clients[d].unmask(server.unmask_request(d))
        if d == tamper:  # a false share of its own b (own=True) or of a neighbour's
            owner, raw = next(e for e in answer.b_shares if (e[0] == d) == own)
            x, y = decode_share(raw)
            answer = replace(answer, b_shares=tuple((o, encode_share(x, (y + 1) % PRIME) if o == owner else r)
                                                    for o, r in answer.b_shares))
        server.receive_unmask(answer)
    total = server.result()
    assert np.array_equal(total, np.sum(np.stack(list(vectors.values())), axis=0, dtype=np.uint32))
    return total


@pytest.mark.parametrize("kind", ["all-zero", "order-8", "one key twice", "another's key"])
def test_a_bad_key_advert_is_refused_and_its_sender_named(kind):
    _, server, clients = _round()
    honest = [d for d in IDS if d != "dev-5"]
    adverts = {d: clients[d].advertise() for d in honest}
    for d in honest:
        server.receive_advert(adverts[d])
    own = clients["dev-5"].advertise()
    c_pk, s_pk = {"all-zero": (bytes(32), own.s_pk), "order-8": (own.c_pk, ORDER_8),
                  "one key twice": (own.c_pk, own.c_pk), "another's key": (adverts["dev-0"].c_pk, own.s_pk)}[kind]
    with pytest.raises(SecAggError):
        server.receive_advert(replace(own, c_pk=c_pk, s_pk=s_pk))  # the rest as its honest advert
    assert "dev-5" in server.faulty and "dev-5" not in server.advertised
    _finish(server, clients, honest)  # the others' round goes on and is unmasked


def test_a_false_share_of_its_own_seed_is_caught_its_sender_named_and_the_sum_honest():
    _, server, clients = _round()
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    _finish(server, clients, list(IDS), tamper="dev-2", own=True)
    assert set(server.faulty) == {"dev-2"} and "false share of its own b_dev-2" in server.faulty["dev-2"]


def test_a_false_share_of_a_neighbours_seed_is_caught_and_the_sum_honest():
    """Not named: the coordinator cannot tell a holder's lie from a dealer that sealed it a false share (a dealer
    would otherwise frame its neighbours: test_attack_redteam_secagg_framing.py)."""
    _, server, clients = _round()
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    _finish(server, clients, list(IDS), tamper="dev-2", own=False)
    assert not server.faulty
