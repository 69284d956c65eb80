"""Value codecs for sparse deltas: how the sent float32 values travel.

========  ====  =====================  =========================================================
codec     id    bytes per value        error bound (x = sent value, y = decoded value)
========  ====  =====================  =========================================================
``fp32``  1     4                      none: bit-exact, -0.0 included (the default)
``fp16``  2     2                      ``|y - x| <= max(2**-11 * |x|, 2**-25)``
``bf16``  3     2                      ``|y - x| <= max(2**-8 * |x|, 2**-134)``
``int8``  4     1 (+ f32 scale/layer)  ``|y - x| <= scale / 2 + 2**-24 * max|x|``, where
                                        ``scale = max|x| / 127`` (per tensor)
========  ====  =====================  =========================================================

fp16 and bf16 round to nearest-even (the half-ulp bounds above; the second term covers
subnormals). fp16 cannot hold ``|x| >= 65520``: encoding such a value raises EncodeError, as does
any non-finite value for every codec. int8 stores ``q = round(x / scale)`` clipped to [-127, 127];
-128 never occurs and is rejected on decode. Every codec is little-endian.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from .errors import EncodeError, WireError

__all__ = ["FP16_MAX", "VALUE_CODECS", "ValueCodec", "decode_values", "encode_values", "value_bytes", "value_codec"]

FP16_MAX = 65504.0  # the largest finite fp16 value


class ValueCodec(IntEnum):
    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4


VALUE_CODECS = {"fp32": ValueCodec.FP32, "fp16": ValueCodec.FP16, "bf16": ValueCodec.BF16,
                "int8": ValueCodec.INT8}
_ITEMSIZE = {ValueCodec.FP32: 4, ValueCodec.FP16: 2, ValueCodec.BF16: 2, ValueCodec.INT8: 1}


def value_codec(name: str) -> ValueCodec:
    try:
        return VALUE_CODECS[name]
    except KeyError:
        raise EncodeError(f"unknown value codec {name!r}; choose one of {', '.join(VALUE_CODECS)}") from None


def value_bytes(codec: ValueCodec, count: int) -> int:
    return _ITEMSIZE[codec] * count


def encode_values(values: np.ndarray, codec: ValueCodec) -> tuple[bytes, float]:
    """(bytes, scale) of finite float32 ``values``; scale is 0.0 except for int8."""
    if codec == ValueCodec.FP32:
        return values.astype("<f4", copy=False).tobytes(), 0.0
    if codec == ValueCodec.FP16:
        with np.errstate(over="ignore"):
            half = values.astype("<f2")
        if not np.isfinite(half).all():
            raise EncodeError(f"a value's magnitude exceeds the fp16 range ({FP16_MAX:g}); use fp32 or bf16")
        return half.tobytes(), 0.0
    if codec == ValueCodec.BF16:
        u = values.astype("<f4", copy=False).view(np.uint32).astype(np.uint64)
        hi = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
        if ((hi & 0x7F80) == 0x7F80).any():
            raise EncodeError("a value's magnitude exceeds the bf16 range after rounding")
        return hi.tobytes(), 0.0
    if codec == ValueCodec.INT8:
        peak = float(np.max(np.abs(values))) if values.size else 0.0
        scale = float(np.float32(peak / 127.0))
        if scale == 0.0:
            return np.zeros(values.size, dtype=np.int8).tobytes(), 0.0
        q = np.clip(np.rint(values.astype(np.float64) / scale), -127, 127).astype(np.int8)
        return q.tobytes(), scale
    raise EncodeError(f"unknown value codec {codec}")


def decode_values(buf: memoryview, codec: int, count: int, scale: float) -> np.ndarray:
    """Finite float32 values (a fresh, writable array); WireError for anything else."""
    if codec not in _ITEMSIZE:
        raise WireError(f"unknown value codec {codec}")
    codec = ValueCodec(codec)
    if len(buf) != value_bytes(codec, count):
        raise WireError(f"values: {len(buf)} bytes, expected {value_bytes(codec, count)} "
                        f"for {count} {codec.name}")
    if codec != ValueCodec.INT8 and scale != 0.0:
        raise WireError(f"values: a scale is only allowed for int8, got {scale!r} with {codec.name}")
    if codec == ValueCodec.FP32:
        out = np.frombuffer(buf, dtype="<f4").astype(np.float32)
    elif codec == ValueCodec.FP16:
        out = np.frombuffer(buf, dtype="<f2").astype(np.float32)
    elif codec == ValueCodec.BF16:
        out = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        if not (np.isfinite(scale) and scale >= 0.0):
            raise WireError(f"values: int8 scale must be finite and >= 0, got {scale!r}")
        q = np.frombuffer(buf, dtype=np.int8)
        if (q == -128).any():
            raise WireError("values: int8 value -128 is outside the codec's range [-127, 127]")
        with np.errstate(over="ignore"):
            out = (q.astype(np.float64) * scale).astype(np.float32)
    if not np.isfinite(out).all():
        raise WireError("values: NaN or Inf in the sent values")
    return out
