"""Stage limits from the fleet's measured timing (coordinator.secure_timing) and the failure bound a round must meet
(flayer.engine.secure_plan.failure_problem)."""

from __future__ import annotations

import pytest

from coordinator.secure_timing import FACTOR, FLOOR_S, StageTiming
from flayer.engine.secure_plan import MAX_FAILURE, failure_problem
from flayer.secagg import neighbour_count
from flayer.secagg.graph import round_failure


def test_a_stage_waits_twice_its_p95_within_the_floor_and_the_ceiling() -> None:
    t = StageTiming(10.0, 40.0)
    t.new_round()
    assert t.limit(1) == 40.0  # nothing measured: the ceiling (a stage ends early when everyone answered)
    for i in range(100):
        t.observe(1, 0.1 * i)  # 0 .. 9.9 s
    assert t.limit(1) == pytest.approx(FACTOR * 9.5)
    t.observe(1, 1000.0)
    for _ in range(200):
        t.observe(1, 500.0)
    assert t.limit(1) == 40.0  # the ceiling
    for _ in range(5):  # the window forgets old rounds
        t.new_round()
    t.observe(2, 0.01)
    assert t.limit(1) == 40.0 and t.limit(2) == FLOOR_S
    t.new_round()
    t.observe(3 - 1, 1.0)
    t.censored(2, 5.0, 10)  # ten live devices cut off at 5 s: the next round waits twice that
    assert t.limit(2) == pytest.approx(FACTOR * 5.0)


def test_the_fallback_is_refused_where_it_would_fail_too_often() -> None:
    k, t = neighbour_count(99, 0.45)
    assert k == 98  # the complete graph
    assert round_failure(99, k, t, 51, 0.45) == pytest.approx(0.212, abs=0.01)
    assert "refused" in (failure_problem(99, k, t, 0.45, 0.0) or "")
    k, t = neighbour_count(99, 0.34)
    assert failure_problem(99, k, t, 0.34, 0.0) is None and round_failure(99, k, t, 51, 0.34) <= MAX_FAILURE
    k, t = neighbour_count(1000, 0.1)  # the sparse rule: far below the bound
    assert round_failure(1000, k, t, 501, 0.1) < 2.0**-20
    assert failure_problem(3, 2, 2, 0.1, 0.0) is None  # a small cohort: stated, never refused
