"""flayer.secagg.outlook.shortfall: which shares a set of survivors could reveal, from what the server saw."""

from __future__ import annotations

from flayer.secagg import RingSpec, SecAggParams
from flayer.secagg.outlook import shortfall

IDS = ("a", "b", "c", "d")


def _params() -> SecAggParams:  # four devices, the complete graph (k = 3), t = 3
    return SecAggParams("fed.1.ab", 1, IDS, 3, 3, bytes(32), 4, RingSpec.for_summands(1.0, len(IDS)))


def _sealed(p: SecAggParams) -> dict[str, frozenset[str]]:
    return {d: p.neighbours(d) for d in IDS}


def test_survivors_holding_t_shares_of_every_secret_fall_short_of_nothing():
    p = _params()
    assert shortfall(p, {"a", "b", "c", "d"}, _sealed(p), (), ()) is None
    assert shortfall(p, {"a", "b", "c"}, _sealed(p), (), ()) is None  # s_d from a, b and c


def test_a_survivor_counts_its_own_share_of_b_but_a_dropped_device_does_not_answer():
    p = _params()
    # b's holders among {a, b, c}: a, c and b itself; d, dropped, is rebuilt from a, b, c
    assert shortfall(p, {"a", "b", "c"}, _sealed(p), (), ()) is None
    short = shortfall(p, {"a", "b"}, _sealed(p), (), ())
    assert short is not None and "fewer than t=3" in short


def test_a_complained_share_is_held_by_nobody():
    p = _params()
    short = shortfall(p, {"a", "b", "c"}, _sealed(p), {("a", "d")}, {"d"})  # d spoiled a's share, then dropped
    assert short is not None and "s_d" in short and short.startswith("2 of")


def test_a_faulty_survivor_answers_nothing_not_even_for_its_own_seed():
    p = _params()
    short = shortfall(p, {"a", "b", "c", "d"}, _sealed(p), {("a", "d")}, {"d"})  # d's masked input was in first
    assert short is not None and "b_d" in short and short.startswith("2 of")
    assert shortfall(p, {"a", "b", "c", "d"}, _sealed(p), (), {"d"}) is None  # a, b, c hold b_d: enough


def test_a_dropped_device_every_answering_neighbour_complained_of_is_unmasked_by_pair_seeds():
    p = _params()
    every = {("a", "d"), ("b", "d"), ("c", "d")}  # d spoiled all its shares: a, b, c reveal their pair seeds
    assert shortfall(p, {"a", "b", "c"}, _sealed(p), every, {"d"}) is None
    some = {("a", "d"), ("b", "d")}  # c holds a share of s_d, a and b none: neither route has enough
    assert "s_d" in (shortfall(p, {"a", "b", "c"}, _sealed(p), some, {"d"}) or "")
    # c's masked input (and so any complaint of it) not in yet: it may still complain, and the round is not short
    assert shortfall(p, {"a", "b", "c"}, _sealed(p), some, {"d"}, pending={"c"}) is None
