"""Dense model blobs: a state dict <-> safetensors bytes, and the digest that names a blob.

safetensors is the ecosystem's standard tensor container: an 8-byte little-endian header length,
a JSON header (per tensor: dtype, shape, data offsets), then the raw little-endian data. No code
runs on load (unlike pickle). :func:`decode_state` parses and checks that header itself before
the library sees the bytes: header length within the buffer and the limits, JSON without duplicate
keys, dtypes from a whitelist, shapes and element counts within the limits, offsets contiguous and
covering the data exactly, float tensors finite, and (optionally) exactly the expected names and
shapes. The digest of a blob is the lowercase sha256 hex of its bytes; encoding is deterministic,
so the same state always yields the same digest (and the same ``model/<digest>/<i>`` topics).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .errors import EncodeError, WireError
from .limits import DEFAULT_LIMITS, WireLimits

__all__ = ["STATE_DTYPES", "blob_digest", "decode_state", "encode_state"]

# safetensors dtype name -> numpy dtype; bf16 and fp8 have no numpy type and are not accepted
STATE_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NUMPY_OK = {dt.newbyteorder("=") for dt in STATE_DTYPES.values()}
MAX_HEADER_BYTES = 16 * 2**20


def blob_digest(blob: bytes | bytearray | memoryview) -> str:
    """sha256 of ``blob`` as 64 lowercase hex characters."""
    return hashlib.sha256(blob).hexdigest()


def encode_state(state: Mapping[str, np.ndarray]) -> bytes:
    """safetensors bytes of ``state`` (numpy arrays of a whitelisted dtype; floats must be finite)."""
    body: dict[str, np.ndarray] = {}
    for name, arr in state.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise EncodeError(f"bad tensor name {name!r}")
        if not isinstance(arr, np.ndarray) or arr.dtype.newbyteorder("=") not in _NUMPY_OK:
            raise EncodeError(f"tensor {name!r}: must be a numpy array of one of {sorted(STATE_DTYPES)}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise EncodeError(f"tensor {name!r}: NaN or Inf values")
        body[name] = np.require(arr.astype(arr.dtype.newbyteorder("<"), copy=False), requirements="C")
    return st_save(body)


def _obj_no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise WireError(f"model blob: header repeats key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> None:
    raise WireError(f"model blob: header contains {name}")


def _parse_header(data: memoryview, limits: WireLimits) -> tuple[int, dict[str, Any]]:
    if len(data) < 8:
        raise WireError(f"model blob: {len(data)} bytes, too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > min(len(data) - 8, MAX_HEADER_BYTES):
        raise WireError(f"model blob: header length {hlen} exceeds the {len(data) - 8} bytes available")
    try:
        header = json.loads(bytes(data[8:8 + hlen]).decode("utf-8"), object_pairs_hook=_obj_no_dupes,
                            parse_constant=_reject_constant)
    except WireError:
        raise
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an over-long integer, deep nesting
        raise WireError(f"model blob: header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise WireError("model blob: header is not a JSON object")
    return 8 + hlen, header


def _check_entries(header: dict[str, Any], data_len: int, limits: WireLimits,
                   expected: Mapping[str, tuple[int, ...]] | None) -> None:
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise WireError("model blob: __metadata__ must map strings to strings")
    if len(header) > limits.max_tensors:
        raise WireError(f"model blob: {len(header)} tensors exceed the limit {limits.max_tensors}")
    spans: list[tuple[int, int, str]] = []
    total = 0
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise WireError(f"model blob: tensor {name!r} entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in STATE_DTYPES:
            raise WireError(f"model blob: tensor {name!r} dtype {dtype!r} not in {sorted(STATE_DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= limits.max_ndim
                and all(type(s) is int and 0 <= s <= limits.max_numel for s in shape)):
            raise WireError(f"model blob: tensor {name!r} has a bad shape {shape!r}")
        numel = math.prod(shape)
        total += numel
        if numel > limits.max_numel or total > limits.max_total_numel:
            raise WireError(f"model blob: tensor {name!r} takes the element count over the limits")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise WireError(f"model blob: tensor {name!r} has bad data offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len or end - begin != numel * STATE_DTYPES[dtype].itemsize:
            raise WireError(f"model blob: tensor {name!r} offsets {offsets} do not fit {dtype} {shape} "
                            f"in {data_len} data bytes")
        if expected is not None and (name not in expected or tuple(expected[name]) != tuple(shape)):
            raise WireError(f"model blob: tensor {name!r} {tuple(shape)} is not in the expected model")
        spans.append((begin, end, name))
    if expected is not None and set(expected) - set(header):
        raise WireError(f"model blob: missing tensors {sorted(set(expected) - set(header))[:5]}")
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise WireError(f"model blob: tensor {name!r} data starts at {begin}, not {at} (gap or overlap)")
        at = end
    if at != data_len:
        raise WireError(f"model blob: tensors cover {at} of {data_len} data bytes")


def decode_state(blob: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS,
                 expected: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """Validated state dict (fresh numpy arrays) of a safetensors blob; WireError otherwise.

    ``expected``: name -> shape the blob must hold exactly (no more, no fewer tensors).
    """
    if len(blob) > limits.max_blob_bytes:
        raise WireError(f"model blob: {len(blob)} bytes exceed the limit {limits.max_blob_bytes}")
    view = memoryview(blob).cast("B")
    start, header = _parse_header(view, limits)
    _check_entries(header, len(view) - start, limits, expected)
    try:
        state = st_load(bytes(view))
    except SafetensorError as exc:
        raise WireError(f"model blob: rejected by safetensors ({exc})") from None
    for name, arr in state.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise WireError(f"model blob: tensor {name!r} has NaN or Inf values")
    return state
