"""The SecAgg+ neighbour graph (symmetric, k-regular, seeded) and the k / t rule (flayer/secagg/graph.py)."""

from __future__ import annotations

import math

import pytest

from flayer.secagg import neighbour_count, neighbour_graph
from flayer.secagg.graph import DEFAULT_FAILURE, _tail_ge, check_degree

IDS = [f"d{i:03d}" for i in range(40)]


@pytest.mark.parametrize(("n", "k"), [(3, 2), (8, 7), (9, 2), (12, 4), (40, 10), (40, 38), (40, 39)])
def test_graph_is_symmetric_regular_and_loop_free(n, k):
    graph = neighbour_graph(IDS[:n], k, b"s" * 32)
    assert set(graph) == set(IDS[:n])
    for u, near in graph.items():
        assert len(near) == k and u not in near
        assert all(u in graph[v] for v in near)


def test_graph_is_a_function_of_the_seed():
    a = neighbour_graph(IDS, 6, b"s" * 32)
    assert a == neighbour_graph(list(reversed(IDS)), 6, b"s" * 32)  # the order given does not matter
    assert a != neighbour_graph(IDS, 6, b"t" * 32)


@pytest.mark.parametrize(("n", "k"), [(10, 3), (10, 9 - 1 + 2), (10, 0), (10, 10), (1, 0)])
def test_degrees_the_ring_cannot_build_are_refused(n, k):
    with pytest.raises(ValueError, match="degree"):
        check_degree(n, k)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_small_rounds_use_the_complete_graph_with_a_majority_threshold(n):
    k, t = neighbour_count(n, 0.1)
    assert k == n - 1
    assert t == max(2, min((k + 1) // 2 + 1, k)) or n == 2
    assert neighbour_count(50, 0.1, complete=True)[0] == 49


@pytest.mark.parametrize("n", [30, 100, 1000, 10_000])
@pytest.mark.parametrize("delta", [0.05, 0.1, 0.2])
def test_the_rule_meets_its_stated_bounds_with_the_smallest_degree(n, delta):
    k, t = neighbour_count(n, delta)
    if k == n - 1:
        return  # fell back to the complete graph
    assert k % 2 == 0 and 2 * math.ceil(math.log2(n)) <= k <= n - 2
    assert t >= (k + 1) // 2 + 1  # a strict majority of the k+1 share holders
    assert n * _tail_ge(k, delta, k - t + 1) <= DEFAULT_FAILURE  # a dropped device keeps t live neighbours
    assert n * delta ** (k // 2) <= DEFAULT_FAILURE  # the survivors' ring stays connected
    if k - 2 >= 2 * math.ceil(math.log2(n)):
        t2 = (k - 2 + 1) // 2 + 1
        assert (n * _tail_ge(k - 2, delta, k - 2 - t2 + 1) > DEFAULT_FAILURE
                or n * delta ** ((k - 2) // 2) > DEFAULT_FAILURE)  # k - 2 would not do
    assert delta > 0.1 or k <= 6 * math.log2(n)  # O(log n); the constant grows with delta


def test_colluders_raise_the_threshold_and_the_degree():
    k0, t0 = neighbour_count(1000, 0.05)
    k1, t1 = neighbour_count(1000, 0.05, corrupt_fraction=0.3)
    assert t1 > t0 and k1 > k0
    assert 1000 * _tail_ge(k1, 0.3, t1) <= DEFAULT_FAILURE  # fewer than t colluders around any device
    assert 1000 * 0.35 ** (k1 // 2) <= DEFAULT_FAILURE  # the honest survivors' ring stays connected


@pytest.mark.parametrize("kwargs", [{"n": 1, "dropout_rate": 0.1}, {"n": 10, "dropout_rate": 1.0},
                                    {"n": 10, "dropout_rate": 0.1, "corrupt_fraction": -0.1},
                                    {"n": 10, "dropout_rate": 0.1, "failure_probability": 0.0}])
def test_rule_inputs_are_validated(kwargs):
    with pytest.raises(ValueError):
        neighbour_count(**kwargs)


def test_without_dropouts_colluders_alone_must_not_cut_the_ring():
    k, t = neighbour_count(100, 0.0, corrupt_fraction=0.2)
    assert 100 * 0.2 ** (k // 2) <= DEFAULT_FAILURE  # the binding condition here: k = 24, not 14
    assert 100 * _tail_ge(k, 0.2, t) <= DEFAULT_FAILURE
