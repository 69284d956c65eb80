"""Server rules: ``carry`` keeps uncontributed coordinates bit-identical, ``zero`` zeroes them;
weights are training-sample counts; bad updates are refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flayer.engine import check
from flayer.aggregate import Aggregator, UpdateError, check_update
from flayer.update import TensorDelta, Update, delta_update


def sparse(shape, idx, values, n):
    idx = np.asarray(idx, dtype=np.int64)
    return Update({"w": TensorDelta(tuple(shape), np.asarray(values, dtype=np.float32), idx)}, n)


def test_carry_and_zero_hand_computed():
    prev = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    a = sparse((4,), [0, 1], [1.0, 1.0], 30)  # client A (30 samples) sends positions 0, 1
    b = sparse((4,), [1, 2], [4.0, -2.0], 10)  # client B (10 samples) sends 1, 2
    carry, zero = Aggregator(prev, "carry"), Aggregator(prev, "zero")
    for agg in (carry, zero):
        agg.fold(a)
        agg.fold(b)
    # carry: per coordinate, weighted mean over senders of (prev + delta); nobody -> prev
    assert carry.result()["w"].tolist() == pytest.approx([2.0, 2.0 + (30 * 1 + 10 * 4) / 40, 1.0, 4.0])
    # zero: every client counts, unsent = 0: sum_senders n_k (prev + delta_k) / sum_all n_k
    expected = [30 * 2.0 / 40, (30 * 3 + 10 * 6) / 40, 10 * 1.0 / 40, 0.0]
    assert zero.result()["w"].tolist() == pytest.approx(expected)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_carry_leaves_uncontributed_bit_identical_and_zero_zeroes_them(n, clients, seed):
    rng = np.random.default_rng(seed)
    prev = torch.from_numpy(rng.normal(size=n).astype(np.float32))
    carry, zero = Aggregator({"w": prev}, "carry"), Aggregator({"w": prev}, "zero")
    sent = np.zeros(n, dtype=bool)
    for _ in range(clients):
        k = int(rng.integers(0, n + 1))
        idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        sent[idx] = True
        up = sparse((n,), idx, rng.normal(size=k).astype(np.float32), int(rng.integers(1, 100)))
        carry.fold(up)
        zero.fold(up)
    assert carry.unsent() == zero.unsent() == int((~sent).sum())
    c, z = carry.result()["w"], zero.result()["w"]
    assert torch.equal(c[~torch.from_numpy(sent)], prev[~torch.from_numpy(sent)])
    assert torch.all(z[~torch.from_numpy(sent)] == 0)


def test_dense_updates_are_the_sample_weighted_mean():
    prev = {"w": torch.zeros(3), "b": torch.ones(2)}
    local1 = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([3.0, 3.0])}
    local2 = {"w": torch.tensor([4.0, 5.0, 6.0]), "b": torch.tensor([0.0, 1.0])}
    for rule in ("carry", "zero"):
        agg = Aggregator(prev, rule)
        agg.fold(delta_update(local1, prev, {"w": None, "b": None}, 1))
        agg.fold(delta_update(local2, prev, {"w": None, "b": None}, 3))
        out = agg.result()
        assert out["w"].tolist() == pytest.approx([3.25, 4.25, 5.25])
        assert out["b"].tolist() == pytest.approx([0.75, 1.5])


def test_tensor_nobody_sent():
    prev = {"w": torch.tensor([1.0, 2.0]), "head": torch.tensor([5.0])}
    up = Update({"w": TensorDelta((2,), np.ones(2, np.float32))}, 4)
    for rule, expected in (("carry", [5.0]), ("zero", [0.0])):
        agg = Aggregator(prev, rule)
        agg.fold(up)
        assert agg.result()["head"].tolist() == expected
    assert torch.equal(Aggregator(prev, "zero").result()["w"], prev["w"])  # nothing folded: unchanged


@pytest.mark.parametrize("update, message", [
    (Update({"x": TensorDelta((2,), np.zeros(2, np.float32))}, 1), "not part of the global model"),
    (Update({"w": TensorDelta((3,), np.zeros(3, np.float32))}, 1), "shape"),
    (Update({"w": TensorDelta((4,), np.zeros(2, np.float32), np.array([1, 1]))}, 1), "strictly increasing"),
    (Update({"w": TensorDelta((4,), np.zeros(1, np.float32), np.array([4]))}, 1), "outside"),
    (Update({"w": TensorDelta((4,), np.array([np.nan], np.float32), np.array([0]))}, 1), "non-finite"),
    (Update({"w": TensorDelta((4,), np.zeros(4, np.float32))}, 0), "num_samples"),
])
def test_bad_updates_are_refused_by_the_gate(update, message):
    with pytest.raises(UpdateError, match=message):
        check(update, Aggregator({"w": torch.zeros(4)}).shapes)


def test_delta_update_takes_explicit_positions_even_where_the_delta_is_zero():
    g = {"w": torch.tensor([1.0, 2.0, 3.0])}
    local = {"w": torch.tensor([1.0, 5.0, 3.0])}
    up = delta_update(local, g, {"w": torch.tensor([0, 1])}, 7)
    d = up.deltas["w"]
    assert d.indices.tolist() == [0, 1] and d.values.tolist() == [0.0, 3.0]  # a sent zero is still sent
    assert up.sent == 2 and up.numel == 3 and up.num_samples == 7


def test_check_update_norm_of_huge_finite_values_and_nan_detection():
    shapes = {"w": (4,)}
    big = np.array([3e30, 4e30, 0, 0], dtype=np.float32)  # squares overflow float32
    norm = check_update(Update({"w": TensorDelta((4,), big)}, 1), shapes)
    assert math.isclose(norm, 5e30, rel_tol=1e-6)
    with pytest.raises(UpdateError, match="norm"):
        check_update(Update({"w": TensorDelta((4,), big)}, 1), shapes, max_norm=1e30)
    for bad in (np.nan, np.inf, -np.inf):
        vals = np.array([1, bad, 0, 0], dtype=np.float32)
        with pytest.raises(UpdateError, match="non-finite"):
            check_update(Update({"w": TensorDelta((4,), vals)}, 1), shapes)
    with pytest.raises(UpdateError, match="strictly increasing"):
        check_update(Update({"w": TensorDelta((4,), np.ones(2, np.float32), np.array([2, 2]))}, 1), shapes)


def test_the_gate_refuses_what_the_decoder_refuses():
    """In process and over the wire the same gate: the decoder given the shapes runs check_update."""
    from protocol import UpdateHeader, WireError, decode_update, encode_update

    up = Update({"w": TensorDelta((4,), np.zeros(4, np.float32))}, 5)
    blob = encode_update(up, UpdateHeader("fed", 1, "dev", "ab" * 32))
    assert decode_update(blob, shapes={"w": (4,)}).norm == check(up, {"w": (4,)}) == 0.0
    assert decode_update(blob).norm is None
    with pytest.raises(WireError, match="not part of the global model"):
        decode_update(blob, shapes={"v": (4,)})
