"""The robust server rules: coordinate-wise median and trimmed mean over the deltas each coordinate
received, the previous global value where nobody sent anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flayer.aggregate import RobustAggregator, is_finite_state, make_aggregator
from flayer.update import TensorDelta, Update


def _up(values: list[float], indices: list[int] | None = None, n: int = 10) -> Update:
    idx = None if indices is None else np.asarray(indices, dtype=np.int64)
    return Update({"w": TensorDelta((4,), np.asarray(values, dtype=np.float32), idx)}, n)


def test_median_per_coordinate_over_the_senders_only() -> None:
    g = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    agg = make_aggregator(g, "median")
    agg.fold(_up([1.0, 10.0, 0.0, 0.0]))
    agg.fold(_up([3.0, 20.0], [0, 1], n=10**9))  # a huge weight counts as one client
    agg.fold(_up([1e30, 30.0], [0, 1]))  # an outlier does not move the median
    out = agg.result()["w"].tolist()
    assert out == [1 + 3.0, 2 + 20.0, 3 + 0.0, 4 + 0.0]  # coordinates 2, 3: one sender (the first)
    assert agg.contributors == 3 and agg.unsent() == 0


def test_even_count_median_is_the_mean_of_the_middle_two() -> None:
    agg = RobustAggregator({"w": torch.zeros(4)}, "median")
    agg.fold(_up([1.0], [2]))
    agg.fold(_up([4.0], [2]))
    out = agg.result()["w"].tolist()
    assert out == [0.0, 0.0, 2.5, 0.0] and agg.unsent() == 3


def test_trimmed_mean_drops_each_end() -> None:
    agg = make_aggregator({"w": torch.zeros(4)}, "trimmed", trim=0.2)
    for v in (-100.0, 1.0, 2.0, 3.0, 100.0):  # 5 senders: floor(0.2 * 5) = 1 dropped at each end
        agg.fold(_up([v, v, v, v]))
    agg.fold(_up([7.0], [3]))  # coordinate 3: 6 senders, still 1 dropped at each end
    out = agg.result()["w"].tolist()
    assert out[:3] == pytest.approx([2.0] * 3)
    assert out[3] == pytest.approx((1 + 2 + 3 + 7) / 4)


def test_trim_zero_is_the_plain_mean_and_bad_rules_are_refused() -> None:
    agg = make_aggregator({"w": torch.zeros(4)}, "trimmed", trim=0.0)
    agg.fold(_up([1.0, 2.0, 3.0, 4.0]))
    agg.fold(_up([3.0, 4.0, 5.0, 6.0]))
    assert agg.result()["w"].tolist() == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="server rule"):
        make_aggregator({"w": torch.zeros(4)}, "mean")
    with pytest.raises(ValueError, match="trim"):
        make_aggregator({"w": torch.zeros(4)}, "trimmed", trim=0.5)


def test_flayer_option_selects_the_rule(digits) -> None:  # type: ignore[no-untyped-def]
    from flayer.config import TrainConfig
    from flayer.strategies import make_strategy

    s = make_strategy("flayer", digits.model_spec(), TrainConfig(), {"server_rule": "trimmed", "server_trim": 0.1})
    agg = s.aggregator({"w": torch.zeros(4)})
    assert isinstance(agg, RobustAggregator) and agg.rule == "trimmed" and agg.trim == 0.1


def test_is_finite_state_names_the_tensor() -> None:
    assert is_finite_state({"a": torch.zeros(2)}) is None
    assert is_finite_state({"a": torch.zeros(2), "b": torch.tensor([1.0, float("inf")])}) == "b"
