"""Whole rounds (flayer/secagg/local.py): the unmasked sum is the survivors' ring sum exactly, dropouts at
every stage are recovered from or end the round with a reason, and each device's traffic is O(k + n)."""

from __future__ import annotations

import numpy as np
import pytest

from flayer.secagg import RingSpec, SecAggParams, decode_sum, encode, run_round


def ids(count: int) -> list[str]:
    return [f"dev-{i:02d}" for i in range(count)]


def params(count: int, degree: int | None = None, threshold: int | None = None, length: int = 32,
           bits: int = 32) -> SecAggParams:
    k = count - 1 if degree is None else degree
    t = (k + 1) // 2 + 1 if threshold is None else threshold
    return SecAggParams("fed-test", 7, tuple(ids(count)), t, k, b"g" * 32, length,
                        RingSpec.for_summands(1.0, count, bits))


def encoded(p: SecAggParams, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    floats = {d: rng.uniform(-1.2, 1.2, p.length) for d in p.participants}
    return floats, {d: encode(v, p.ring, rng) for d, v in floats.items()}


def ring_sum(vectors: dict[str, np.ndarray], devices) -> np.ndarray:
    total = np.zeros(next(iter(vectors.values())).shape, dtype=np.uint32)
    for d in devices:
        total += vectors[d]
    return total


@pytest.mark.parametrize(("count", "degree", "threshold", "length"), [
    (3, None, None, 1), (5, None, None, 7), (8, None, None, 64), (12, 4, 3, 33), (20, 6, 4, 100),
    (30, 8, 5, 257), (30, None, 16, 50), (30, 10, 2, 5)])
def test_the_unmasked_sum_is_exactly_the_plain_ring_sum(count, degree, threshold, length):
    p = params(count, degree, threshold, length)
    floats, vectors = encoded(p, seed=count)
    out = run_round(p, vectors, seed=b"r")
    assert out.abandoned_reason is None and out.survivors == set(p.participants) and not out.dropped
    assert np.array_equal(out.ring_sum, ring_sum(vectors, p.participants))
    exact = np.sum([np.clip(v, -1, 1) for v in floats.values()], axis=0)
    assert np.all(np.abs(out.sum - exact) <= count / p.ring.scale)


def test_a_round_from_the_rule_and_a_narrow_ring_sum_exactly():
    p = SecAggParams.for_round("fed-test", 1, ids(30), 40, RingSpec.for_summands(1.0, 30), b"q" * 32, 0.05)
    assert p.degree < 29  # the sparse graph
    _, vectors = encoded(p, seed=1)
    out = run_round(p, vectors, {"dev-03": "after_shares"}, seed=b"r")
    assert np.array_equal(out.ring_sum, ring_sum(vectors, out.survivors))
    narrow = params(6, bits=12)  # the masks are mod 2^32, the values mod 2^12: the sum is right mod 2^12
    floats, vectors = encoded(narrow, seed=2)
    total = run_round(narrow, vectors, seed=b"r").sum
    assert np.all(np.abs(total - np.sum([np.clip(v, -1, 1) for v in floats.values()], axis=0))
                  <= 6 / narrow.ring.scale)


def test_the_same_seed_gives_the_same_round_and_masks_differ_between_seeds():
    p = params(5)
    _, vectors = encoded(p)
    a, b = run_round(p, vectors, seed=b"x"), run_round(p, vectors, seed=b"x")
    assert np.array_equal(a.ring_sum, b.ring_sum) and a.bytes_per_device == b.bytes_per_device
    assert np.array_equal(run_round(p, vectors).ring_sum, a.ring_sum)  # os.urandom: other masks, same sum


@pytest.mark.parametrize("point", ["before_keys", "after_keys", "after_shares", "after_masked", "after_consent"])
@pytest.mark.parametrize(("count", "degree", "threshold"), [(7, None, None), (16, 6, 3)])
def test_one_dropout_at_each_stage_is_recovered(point, count, degree, threshold):
    p = params(count, degree, threshold)
    _, vectors = encoded(p, seed=3)
    victim = "dev-04"
    out = run_round(p, vectors, {victim: point}, seed=b"r")
    assert out.abandoned_reason is None and not out.refusals
    in_sum = set(p.participants) - ({victim} if point != "after_consent" else set())
    assert out.survivors == in_sum  # a device that consented is summed even if it then leaves; one that sent its
    # masked input and left before consenting is dropped: its input is taken back out of the sum
    assert out.dropped == ({victim} if point in ("after_shares", "after_masked") else set())
    assert np.array_equal(out.ring_sum, ring_sum(vectors, in_sum))


def test_dropouts_at_every_stage_together_are_recovered():
    p = params(20, 8, 4)
    _, vectors = encoded(p, seed=4)
    drops = {"dev-01": "before_keys", "dev-05": "after_keys", "dev-09": "after_shares",
             "dev-10": "after_shares", "dev-15": "after_masked", "dev-17": "after_consent"}
    out = run_round(p, vectors, drops, seed=b"r")
    assert out.abandoned_reason is None
    assert out.dropped == {"dev-09", "dev-10", "dev-15"}
    assert out.survivors == set(p.participants) - {"dev-01", "dev-05", "dev-09", "dev-10", "dev-15"}
    assert np.array_equal(out.ring_sum, ring_sum(vectors, out.survivors))
    assert np.array_equal(out.sum, decode_sum(out.ring_sum, p.ring, len(out.survivors)))


@pytest.mark.parametrize(("point", "reason"), [
    ("before_keys", "2 devices advertised keys, fewer than t=3"),
    ("after_keys", "2 devices sent shares, fewer than t=3"),
    ("after_shares", "2 devices sent a masked input, fewer than t=3"),
    ("after_masked", "2 devices sent a masked input and consented, fewer than t=3"),
    ("after_consent", "2 survivors signed the survivor set, fewer than T=4")])
def test_too_many_dropouts_abandon_the_round_with_a_reason(point, reason):
    p = params(5)  # complete graph, t = 3
    _, vectors = encoded(p)
    out = run_round(p, vectors, dict.fromkeys(["dev-00", "dev-01", "dev-02"], point), seed=b"r")
    assert out.ring_sum is None and out.sum is None
    assert out.abandoned_reason is not None and reason in out.abandoned_reason
    if point == "after_consent":  # 5 survivors, 2 answer: too few sign the set (T = 4 of 5) ...
        from flayer.engine.secure import abandon_kind

        assert abandon_kind(out.abandoned_reason) == "too_few"  # the exporter's reason label
        out = run_round(p, vectors, dict.fromkeys(["dev-00", "dev-01", "dev-02"], point), seed=b"r", consistency=False)
        assert "shares of b_" in out.abandoned_reason  # ... and without the consistency round no b_u has t shares


def test_a_dropped_device_whose_neighbours_also_left_cannot_be_unmasked():
    p = params(12, 4, 3)
    _, vectors = encoded(p)
    victim = "dev-00"
    near = sorted(p.neighbours(victim))
    # the victim's two farthest neighbours on the ring (no common neighbour but the victim): every
    # survivor keeps 3 live holders of its b, but the victim's s keeps only 2 of its 4
    a, b = next((a, b) for a in near for b in near if p.neighbours(a) & p.neighbours(b) == {victim})
    out = run_round(p, vectors, {victim: "after_shares", a: "after_masked", b: "after_masked"}, seed=b"r")
    assert out.abandoned_reason == "2 shares of s_dev-00 arrived, fewer than t=3"


def test_traffic_grows_with_k_and_n_not_with_the_participants():
    def worst(count: int, degree: int, length: int, consistency: bool = False) -> int:
        p = params(count, degree, 3, length)
        return max(run_round(p, encoded(p)[1], seed=b"r", consistency=consistency).bytes_per_device.values())

    small, large = worst(10, 4, 100), worst(40, 4, 100)
    assert large == small  # same k and n, four times the devices: the same bytes per device
    assert worst(10, 4, 1100) - small == 4 * 1000  # the masked input: 4 bytes a coordinate, nothing else
    assert worst(10, 8, 100) > small
    p = params(10, 4, 3, 100)
    assert set(run_round(p, encoded(p)[1], seed=b"r", consistency=False).messages_per_device.values()) == {7}
    # the long-term keys add the adverts' signatures; the consistency round two messages, the whole survivor set
    # (7 B an id here) and T signatures (7 + 64 B); the consent stage two more: the request (10 + 7 B), the consent
    # (10 + 7 + 64 B), and the unmask request carries the consent of each other survivor it lists (k = 4: 7 + 64 B)
    assert set(run_round(p, encoded(p)[1], seed=b"r").messages_per_device.values()) == {11}
    for count in (10, 40):
        t_sig = count // 2 + 1  # T = floor((P + 1) / 2) + 1 at gamma = 0: P // 2 + 1
        extra = (10 + 7 + 2 + 7 * count) + (10 + 7 + 64) + 71 * t_sig
        extra += (10 + 7) + (10 + 7 + 64) + 4 * 71  # the consent stage
        extra += 2 * 64 * 4  # the signed adverts: 64 B a neighbour (k = 4) in the advert and in the bundle
        extra += 2 * 64 * 4  # the signed sealed shares: 64 B a neighbour sent, and as many received
        assert worst(count, 4, 100, consistency=True) - worst(count, 4, 100) == extra


def test_run_round_validates_its_inputs():
    p = params(4)
    _, vectors = encoded(p)
    with pytest.raises(ValueError, match="not a participant"):
        run_round(p, vectors, {"stranger": "after_keys"})
    with pytest.raises(ValueError, match="must be one of"):
        run_round(p, vectors, {"dev-00": "sometime"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="no vector"):
        run_round(p, {d: v for d, v in vectors.items() if d != "dev-01"})
    run_round(p, {d: v for d, v in vectors.items() if d != "dev-01"}, {"dev-01": "after_shares"})
