"""A device that repeats a key under another encoding (docs/explanation/secure-aggregation.md, "Faults named and
left out": the coordinator refuses a key another device advertised first, or one key for both purposes).

X25519 ignores the top bit of a public key and reads u and u + p as the same point, so one key has several
32-byte encodings. The adversary is one participant (or two colluding ones): it advertises a key it knows -- a
colluder's, or its own other key -- with the top bit set, or as u + p. The guarantee: refused as the key it
repeats, and its sender named, as the plain copy is (test_attack_secagg_keys.py); a bundle holding one is refused
by the device too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from flayer.secagg import KeyBundle, RingSpec, SecAggClient, SecAggError, SecAggParams, SecAggServer

IDS = tuple(f"dev-{i}" for i in range(6))
P = 2**255 - 19


def _top_bit(key: bytes) -> bytes:
    return key[:31] + bytes([key[31] | 0x80])


def _plus_p(u: int) -> bytes:
    return (u + P).to_bytes(32, "little")  # fits in 255 bits for u < 19: another encoding of u


@pytest.mark.parametrize("kind", ["a colluder's key, top bit set", "its own key twice, top bit set"])
def test_a_repeated_key_in_another_encoding_is_refused_and_its_sender_named(kind):
    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    server, clients = SecAggServer(params), {d: SecAggClient(params, d) for d in IDS}
    adverts = {d: clients[d].advertise() for d in IDS}
    for d in IDS[:5]:
        server.receive_advert(adverts[d])
    own = adverts["dev-5"]
    forged = (replace(own, c_pk=_top_bit(adverts["dev-4"].c_pk)) if kind.startswith("a colluder")
              else replace(own, s_pk=_top_bit(own.c_pk)))
    with pytest.raises(SecAggError):
        server.receive_advert(forged)
    assert "dev-5" in server.faulty and "dev-5" not in server.advertised
    # a device refuses a bundle that holds such a key too (a coordinator relaying it)
    bundle = server.key_bundle("dev-0")
    with pytest.raises(SecAggError):
        clients["dev-0"].share_keys(KeyBundle(1, "dev-0", bundle.adverts + (forged,)))


def test_a_small_key_written_as_u_plus_p_is_refused():
    """u + p (u < 19) is a second encoding of u, never one an honest device advertises: refused whatever u is."""
    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    for u in range(19):
        server = SecAggServer(params)
        own = SecAggClient(params, "dev-5").advertise()
        with pytest.raises(SecAggError):
            server.receive_advert(replace(own, c_pk=_plus_p(u)))
