"""Key agreement, HKDF domain separation, the sealed shares' binding, and the ChaCha20 PRG."""

from __future__ import annotations

import numpy as np
import pytest

from flayer.secagg import SecAggError, SeededEntropy, expand
from flayer.secagg import keys as K
from flayer.secagg.prg import MAX_LENGTH, randbelow_from


@pytest.fixture
def pair():
    entropy = SeededEntropy(b"k" * 32)
    return K.generate_keypair(entropy), K.generate_keypair(entropy), entropy


def test_both_sides_derive_the_same_seed_and_key(pair):
    a, b, _ = pair
    ab, ba = K.agree(a.private, b.public), K.agree(b.private, a.public)
    assert ab == ba
    assert K.derive_mask_seed(ab, "fed", 3, "u", "v") == K.derive_mask_seed(ba, "fed", 3, "v", "u")
    assert K.derive_aead_key(ab, "fed", 3, "u", "v") == K.derive_aead_key(ba, "fed", 3, "v", "u")


def test_derivations_are_separated_by_purpose_round_session_and_pair(pair):
    a, b, _ = pair
    shared = K.agree(a.private, b.public)
    seeds = {K.derive_mask_seed(shared, "fed", 3, "u", "v"), K.derive_aead_key(shared, "fed", 3, "u", "v"),
             K.derive_mask_seed(shared, "fed", 4, "u", "v"), K.derive_mask_seed(shared, "fed2", 3, "u", "v"),
             K.derive_mask_seed(shared, "fed", 3, "u", "w")}
    assert len(seeds) == 5


def test_a_low_order_public_key_is_refused(pair):
    a, _, _ = pair
    with pytest.raises(SecAggError, match="agreement"):
        K.agree(a.private, bytes(32))  # the all-zero point: the shared secret would be zero
    with pytest.raises(SecAggError, match="32 bytes"):
        K.agree(a.private, bytes(31))


def test_public_from_private_matches_generation(pair):
    a, _, _ = pair
    assert K.public_from_private(a.private) == a.public
    assert "private" not in repr(a)


def test_a_sealed_share_opens_only_under_its_own_binding(pair):
    _, _, entropy = pair
    key = bytes(range(32))
    plan = bytes(32)
    ad = K.associated_data("fed", 3, "u", "v", 2, plan)
    sealed = K.seal(key, b"share pair", ad, entropy)
    assert K.open_sealed(key, sealed, ad, "share") == b"share pair"
    others = [K.associated_data("fed", 4, "u", "v", 2, plan),  # replayed from another round
              K.associated_data("fed2", 3, "u", "v", 2, plan),  # another session
              K.associated_data("fed", 3, "u", "w", 2, plan),  # misaddressed
              K.associated_data("fed", 3, "w", "v", 2, plan),  # another sender
              K.associated_data("fed", 3, "v", "u", 2, plan),  # the reverse direction
              K.associated_data("fed", 3, "u", "v", 3, plan),  # another stage
              K.associated_data("fed", 3, "u", "v", 2, bytes([1]) * 32)]  # another plan (cohort, k, t, ...)
    for other in others:
        with pytest.raises(SecAggError, match="does not authenticate"):
            K.open_sealed(key, sealed, other, "share")
    for i in (0, 12, len(sealed) - 1):  # nonce, ciphertext, tag
        forged = bytearray(sealed)
        forged[i] ^= 1
        with pytest.raises(SecAggError, match="does not authenticate"):
            K.open_sealed(key, bytes(forged), ad, "share")
    with pytest.raises(SecAggError, match="too short"):
        K.open_sealed(key, sealed[:20], ad, "share")


def test_session_ids_are_validated():
    with pytest.raises(ValueError, match="session"):
        K.check_session("")
    with pytest.raises(ValueError, match="session"):
        K.check_session("fed 1")


def test_prg_is_the_chacha20_keystream():
    # RFC 8439 / RFC 7539 A.1 test vector 1: key and nonce zero, counter 0 -> 76 b8 e0 ad a0 f1 3d 90 ...
    out = expand(bytes(32), 4)
    assert out.tobytes()[:8].hex() == "76b8e0ada0f13d90"
    assert out.dtype == np.uint32 and out[0] == 0xADE0B876


def test_prg_is_deterministic_prefix_stable_and_seed_dependent():
    a, b = expand(b"a" * 32, 1000), expand(b"b" * 32, 1000)
    assert np.array_equal(a, expand(b"a" * 32, 1000))
    assert np.array_equal(a[:10], expand(b"a" * 32, 10))
    assert np.mean(a == b) < 0.01
    a += 1  # writable
    assert expand(b"a" * 32, 0).size == 0
    with pytest.raises(ValueError, match="seed"):
        expand(b"short", 3)
    with pytest.raises(ValueError, match="n must"):
        expand(b"a" * 32, MAX_LENGTH + 1)


def test_seeded_entropy_is_a_reproducible_stream():
    e1, e2 = SeededEntropy(bytes(32)), SeededEntropy(bytes(32))
    assert e1(5) + e1(7) == e2(12)
    draw = randbelow_from(SeededEntropy(b"r" * 32))
    values = [draw(10) for _ in range(2000)]
    assert set(values) == set(range(10))
    assert max(values.count(v) for v in range(10)) < 300  # ~200 each
