"""Sparse-update codec: property round trips (fp32 bit-exact, quantised within the stated bounds),
header and shape checks, encode-side validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flayer.update import TensorDelta, Update
from protocol import (
    EncodeError,
    UpdateHeader,
    UpdateOptions,
    WireError,
    WireLimits,
    decode_update,
    encode_update,
    update_sizer,
)
from protocol.values import ValueCodec, decode_values, encode_values

HEADER = UpdateHeader("fed-1", 7, "client_03", "ab" * 32)
SPECIAL = np.array(
    [0.0, -0.0, 1e-45, -1e-40, 1.5e-38, 3.4e38, -3.4e38, 1.0, -2.5e-3, 65504.0], dtype=np.float32
)


def _delta(rng: np.random.Generator, shape: tuple[int, ...], density: float, dense: bool) -> TensorDelta:
    numel = math.prod(shape)
    scale = float(10.0 ** rng.uniform(-6, 2))
    if dense:
        vals = (rng.standard_normal(numel) * scale).astype(np.float32)
        return TensorDelta(shape, vals)
    m = int(round(density * numel))
    idx = np.sort(rng.choice(numel, size=m, replace=False)).astype(np.int64)
    vals = (rng.standard_normal(m) * scale).astype(np.float32)
    return TensorDelta(shape, vals, idx)


def _random_update(seed: int, ntensors: int, density: float, special: bool) -> Update:
    rng = np.random.default_rng(seed)
    deltas = {}
    for t in range(ntensors):
        shape = tuple(int(s) for s in rng.integers(0, 13, size=rng.integers(0, 4)))
        d = _delta(
            rng, shape, float(np.clip(density + rng.uniform(-0.2, 0.2), 0, 1)), bool(rng.random() < 0.2)
        )
        if special and d.values.size:
            d.values[: min(d.values.size, SPECIAL.size)] = SPECIAL[: d.values.size]
        deltas[f"layer{t}.weight"] = d
    info = {"acc_val": float(rng.random()), "train_loss": float(rng.uniform(0, 5))}
    return Update(deltas, int(rng.integers(1, 10_000)), info)


def _dense(d: TensorDelta) -> np.ndarray:
    return d.to_dense().reshape(-1)


def _positions(d: TensorDelta) -> np.ndarray:
    return np.arange(d.numel) if d.indices is None else d.indices


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    ntensors=st.integers(0, 4),
    density=st.floats(0, 1),
    zstd=st.booleans(),
    special=st.booleans(),
)
def test_fp32_round_trip_is_bit_exact(
    seed: int, ntensors: int, density: float, zstd: bool, special: bool
) -> None:
    update = _random_update(seed, ntensors, density, special)
    blob = encode_update(update, HEADER, UpdateOptions("fp32", zstd))
    shapes = {k: d.shape for k, d in update.deltas.items()}
    out = decode_update(blob, shapes=shapes, expect=HEADER)
    assert out.header == HEADER and out.compressed == zstd
    assert out.update.num_samples == update.num_samples and dict(out.update.info) == dict(update.info)
    assert list(out.update.deltas) == list(update.deltas)
    for name, d in update.deltas.items():
        got = out.update.deltas[name]
        assert got.shape == d.shape and got.values.dtype == np.float32 and got.values.flags.writeable
        np.testing.assert_array_equal(_positions(got), _positions(d))
        assert got.values.view(np.uint32).tobytes() == d.values.view(np.uint32).tobytes()  # -0.0 included


# (codec, bound(x, values) -> max allowed |y - x|), the bounds stated in protocol.values
BOUNDS = {
    "fp16": lambda x, v: np.maximum(2.0**-11 * np.abs(x), 2.0**-25),
    "bf16": lambda x, v: np.maximum(2.0**-8 * np.abs(x), 2.0**-134),
    "int8": lambda x, v: (np.abs(v).max() / 127) / 2 + 2.0**-24 * np.abs(v).max(),
}


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    codec=st.sampled_from(sorted(BOUNDS)),
    density=st.floats(0, 1),
    zstd=st.booleans(),
)
def test_quantised_round_trip_within_stated_bound(seed: int, codec: str, density: float, zstd: bool) -> None:
    update = _random_update(seed, 3, density, special=False)
    out = decode_update(encode_update(update, HEADER, UpdateOptions(codec, zstd))).update
    for name, d in update.deltas.items():
        got = out.deltas[name]
        np.testing.assert_array_equal(_positions(got), _positions(d))
        if d.values.size:
            x = d.values.astype(np.float64)
            err = np.abs(got.values.astype(np.float64) - x)
            assert (err <= BOUNDS[codec](x, x)).all(), (codec, float(err.max()))


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_quantised_bounds_hold_on_extreme_values(codec: str) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [SPECIAL[:-4], (rng.standard_normal(5000) * 10.0 ** rng.uniform(-30, 4, 5000))]
    ).astype(np.float32)
    if codec != "int8":  # values past the largest finite fp16 / bf16 are an encode error (tested below)
        x = x[np.abs(x) < (65000 if codec == "fp16" else 3.38e38)]
    data, scale = encode_values(x, ValueCodec[codec.upper()])
    y = decode_values(memoryview(data), ValueCodec[codec.upper()], x.size, scale).astype(np.float64)
    x64 = x.astype(np.float64)
    assert (np.abs(y - x64) <= BOUNDS[codec](x64, x64)).all()


def test_fp16_overflow_and_non_finite_values_are_encode_errors() -> None:
    big = Update({"w": TensorDelta((2,), np.array([1.0, 70000.0], np.float32))}, 1)
    with pytest.raises(EncodeError, match="fp16"):
        encode_update(big, HEADER, UpdateOptions("fp16"))
    encode_update(big, HEADER, UpdateOptions("bf16"))  # fits bf16
    huge = Update({"w": TensorDelta((1,), np.array([3.4e38], np.float32))}, 1)
    with pytest.raises(EncodeError, match="bf16"):
        encode_update(huge, HEADER, UpdateOptions("bf16"))
    for bad in (np.nan, np.inf, -np.inf):
        u = Update({"w": TensorDelta((2,), np.array([1.0, bad], np.float32), np.array([0, 1]))}, 1)
        with pytest.raises(EncodeError, match="NaN or Inf"):
            encode_update(u, HEADER)


@pytest.mark.parametrize(
    "delta, reason",
    [
        (TensorDelta((4,), np.zeros(2, np.float32), np.array([2, 1])), "strictly increasing"),
        (TensorDelta((4,), np.zeros(2, np.float32), np.array([1, 1])), "strictly increasing"),
        (TensorDelta((4,), np.zeros(2, np.float32), np.array([1, 4])), "strictly increasing"),
        (TensorDelta((4,), np.zeros(1, np.float32), np.array([-1])), "strictly increasing"),
        (TensorDelta((4,), np.zeros(2, np.float32), np.array([1, 2, 3])), "one per value"),
        (TensorDelta((4,), np.zeros(3, np.float32)), "dense delta"),
        (TensorDelta((4,), np.zeros(4, np.float64)), "float32"),
        (TensorDelta((4,), np.zeros(2, np.float32), np.array([0.0, 1.0])), "integer"),
    ],
)
def test_encode_rejects_bad_deltas(delta: TensorDelta, reason: str) -> None:
    with pytest.raises(EncodeError, match=reason):
        encode_update(Update({"w": delta}, 3), HEADER)


def test_encode_rejects_bad_header_and_options() -> None:
    u = Update({"w": TensorDelta((1,), np.zeros(1, np.float32))}, 3)
    for header in (
        UpdateHeader("bad/fed", 1, "c", "ab" * 32),
        UpdateHeader("f", -1, "c", "ab" * 32),
        UpdateHeader("f", 1, "c+", "ab" * 32),
        UpdateHeader("f", 1, "c", "AB" * 32),
    ):
        with pytest.raises(EncodeError):
            encode_update(u, header)
    with pytest.raises(EncodeError):
        encode_update(Update(u.deltas, 0), HEADER)
    with pytest.raises(EncodeError):
        encode_update(Update(u.deltas, 1, {"x": float("nan")}), HEADER)
    with pytest.raises(EncodeError):
        UpdateOptions("fp8")


def test_decode_checks_expected_shapes_header_and_limits() -> None:
    u = Update(
        {
            "a": TensorDelta((3, 4), np.ones(12, np.float32)),
            "b": TensorDelta((100,), np.ones(3, np.float32), np.array([1, 50, 99])),
        },
        5,
    )
    blob = encode_update(u, HEADER)
    decode_update(blob, shapes={"a": (3, 4), "b": (100,), "c": (2,)})  # a subset of the model is fine
    with pytest.raises(WireError, match="not part of the global model"):
        decode_update(blob, shapes={"a": (3, 4)})
    with pytest.raises(WireError, match="shape"):
        decode_update(blob, shapes={"a": (4, 3), "b": (100,)})
    with pytest.raises(WireError, match="does not match the expected"):
        decode_update(blob, expect=UpdateHeader("fed-1", 8, "client_03", "ab" * 32))
    with pytest.raises(WireError, match="limit"):
        decode_update(blob, WireLimits(max_numel=50))
    with pytest.raises(WireError, match="limit"):
        decode_update(blob, WireLimits(max_total_numel=100))
    with pytest.raises(WireError, match="limit"):
        decode_update(blob, WireLimits(max_blob_bytes=len(blob) - 1))
    with pytest.raises(WireError, match="limits"):
        decode_update(blob, WireLimits(max_tensors=1))


def test_sparse_is_smaller_than_index_plus_value_and_sizer_agrees() -> None:
    rng = np.random.default_rng(1)
    numel, m = 100_000, 1_000
    idx = np.sort(rng.choice(numel, m, replace=False))
    u = Update({"w": TensorDelta((numel,), rng.standard_normal(m).astype(np.float32), idx)}, 1)
    blob = encode_update(u, HEADER)
    assert len(blob) < m * 4 + m * 1.2 + 200  # ~8.1 bits per position at 1% density, vs 32 for int32
    assert update_sizer()(u) == len(blob) + len("client-0000") - len("client_03") + len("federation") - len(
        "fed-1"
    )


def test_zstd_payload_is_capped_by_what_the_model_holds() -> None:
    """A small zstd frame that inflates beyond the dense size of the model is refused before any
    decompression; the header alone is readable without touching the payload."""
    from protocol import payload_bound, read_update_head

    shapes = {"a": (3, 4)}
    u = Update({"a": TensorDelta((3, 4), np.ones(12, np.float32))}, 5)
    ok = encode_update(u, HEADER, UpdateOptions(zstd=True))
    assert decode_update(ok, shapes=shapes).update.num_samples == 5
    big = Update({"a": TensorDelta((3, 4), np.ones(12, np.float32)),
                  "pad": TensorDelta((1 << 20,), np.zeros(1 << 20, np.float32))}, 5)
    bomb = encode_update(big, HEADER, UpdateOptions(zstd=True))
    assert len(bomb) < 10_000 and payload_bound(shapes) < 200
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_update(bomb, shapes=shapes)
    head = read_update_head(bomb)
    assert head.header == HEADER and head.compressed and head.payload_bytes > 4 << 20 and head.num_samples == 5
    with pytest.raises(WireError, match="bad magic"):
        read_update_head(b"XXXX" + bomb[4:])
