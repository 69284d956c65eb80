"""Model deltas: the change from one published global model to the next, coded as an update blob.

A delta download lets a device that holds global model ``base`` fetch only what changed on the way
to the next one. The delta is an ordinary sparse-update blob (:mod:`protocol.update_codec`: the same
position codecs, value codecs and zstd), whose header's base digest names ``base`` and whose info
entry ``delta_mode`` says how its values apply:

``exact`` (mode 0, replace)
    The positions whose bits changed, with the *new* fp32 values: the device overwrites them.
    Lossless by construction (no float arithmetic), so any model can be sent this way.
``fp16`` / ``int8`` (mode 1, add)
    The positions whose value changed, with ``new - old`` coded by that value codec: the device
    adds the decoded values. This is lossy, so the published model is *defined* as the
    reconstruction ``old + decoded delta`` (:func:`apply_delta` run by the coordinator on its
    own blob): the coordinator takes that model as its global model, and devices compute it with
    the same function from the same bytes, so both agree bit for bit. A change the codec cannot
    hold (beyond fp16's range, beyond float32's, no finite int8 scale) makes :func:`make_delta`
    raise EncodeError; the coordinator then sends that delta ``exact``.

Positions travel dense when every coordinate changed, else in the smallest of the sparse
encodings. :class:`DeltaRef` is what the round plan carries (its ``delta`` field): the base
model's digest and the delta blob's digest, chunk count and size; the blob's chunks are retained
under ``model/<delta digest>/<i>`` like a model's. A device checks the digest of what it rebuilt
against the plan's model digest and falls back to the full model on any mismatch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flayer.update import TensorDelta, Update

from .errors import EncodeError, WireError
from .limits import DEFAULT_LIMITS, WireLimits
from .update_codec import UpdateHeader, UpdateOptions, decode_update, encode_update

__all__ = ["CHAIN", "DELTA_MODES", "DeltaRef", "apply_delta", "chain_entry", "chain_refs", "delta_ref", "make_delta"]

CHAIN = 8  # deltas a coordinator keeps: a device holding any of the last CHAIN models rebuilds the current

DELTA_MODES = ("off", "exact", "fp16", "int8")
MODE_KEY = "delta_mode"
_REPLACE, _ADD = 0.0, 1.0
_DIGEST = re.compile(r"[0-9a-f]{64}")
_REF_KEYS = {"base", "digest", "chunks", "size"}


@dataclass(frozen=True)
class DeltaRef:
    """The delta a round plan offers: from model ``base`` (digest) to the plan's model."""

    base: str
    digest: str
    chunks: int
    size: int
    target: str = ""  # the model it rebuilds (a chain's older link); "" for the plan's own delta

    def as_plan(self) -> dict[str, str | int]:
        return {"base": self.base, "digest": self.digest, "chunks": self.chunks, "size": self.size}


def delta_ref(field: Mapping[str, Any]) -> DeltaRef | None:
    """The plan's ``delta`` field as a :class:`DeltaRef` (None when empty); WireError when malformed."""
    if not field:
        return None
    if set(field) != _REF_KEYS:
        raise WireError(f"plan delta: fields must be exactly {sorted(_REF_KEYS)}, got {sorted(field)}")
    base, digest, chunks, size = field["base"], field["digest"], field["chunks"], field["size"]
    for name, value in (("base", base), ("digest", digest)):
        if not isinstance(value, str) or not _DIGEST.fullmatch(value):
            raise WireError(f"plan delta: {name} must be 64 lowercase hex characters (sha256)")
    for name, value in (("chunks", chunks), ("size", size)):
        if type(value) is not int or not 1 <= value < 2**63:
            raise WireError(f"plan delta: {name} must be a positive integer, got {value!r}")
    return DeltaRef(base, digest, chunks, size)


def chain_entry(ref: DeltaRef) -> str:
    """One entry of the plan's ``delta_chain``: ``base:target:digest:chunks:size``."""
    return f"{ref.base}:{ref.target}:{ref.digest}:{ref.chunks}:{ref.size}"


def chain_refs(entries: tuple[str, ...] | list[str]) -> list[DeltaRef]:
    """The plan's ``delta_chain`` entries as DeltaRefs (with targets); WireError when malformed."""
    out = []
    for entry in entries:
        parts = entry.split(":") if isinstance(entry, str) else []
        if len(parts) != 5 or not all(_DIGEST.fullmatch(p) for p in parts[:3]) \
                or not all(p.isdigit() and 0 < int(p) < 2**63 for p in parts[3:]):
            raise WireError(f"plan delta_chain: entry {str(entry)[:80]!r} is not base:target:digest:chunks:size")
        out.append(DeltaRef(parts[0], parts[2], int(parts[3]), int(parts[4]), parts[1]))
    return out


def _check_pair(base: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray]) -> None:
    if list(base) != list(target):
        raise EncodeError("model delta: the two models must hold the same tensors in the same order")
    for name, old in base.items():
        new = target[name]
        if old.dtype != np.float32 or new.dtype != np.float32 or old.shape != new.shape:
            raise EncodeError(f"model delta: tensor {name!r} must be float32 of one shape in both models")


FP16_LIMIT = 65520.0  # the smallest magnitude that fp16 rounds to infinity (its largest value is 65504)


def _check_lossy(name: str, values: np.ndarray, mode: str) -> None:
    """EncodeError, naming the tensor, when the changes ``values`` cannot travel in ``mode``: a change
    that overflows float32, one beyond fp16's range, or an int8 scale that is not a positive finite
    float32 (the caller then sends the delta exact)."""
    if not values.size:
        return
    if not np.isfinite(values).all():
        raise EncodeError(f"model delta: tensor {name!r} changes by more than float32 can hold")
    peak = float(np.max(np.abs(values)))
    if mode == "fp16" and peak >= FP16_LIMIT:
        raise EncodeError(f"model delta: tensor {name!r} changes by {peak:g}, beyond fp16's range (65504)")
    if mode == "int8" and not 0.0 < float(np.float32(peak / 127.0)) * 127.0 < float(np.finfo(np.float32).max):
        raise EncodeError(f"model delta: tensor {name!r} changes by {peak:g}: no finite int8 scale codes it")


def make_delta(base: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray], mode: str,
               header: UpdateHeader) -> bytes:
    """The delta blob from ``base`` to ``target`` (float32 state dicts of one architecture).

    ``mode``: exact | fp16 | int8 (see module docstring); ``header.base_digest`` names ``base``.
    EncodeError when the models differ in tensors or shapes, or when a lossy mode cannot hold a change
    (one beyond fp16's range or float32's, an int8 scale that is not finite or underflows to 0): the
    caller then falls back to ``exact``, which codes any pair of finite models."""
    if mode not in DELTA_MODES[1:]:
        raise EncodeError(f"model delta: mode must be one of {', '.join(DELTA_MODES[1:])}, got {mode!r}")
    _check_pair(base, target)
    deltas: dict[str, TensorDelta] = {}
    for name, old in base.items():
        old_flat = np.ascontiguousarray(old).reshape(-1)
        new_flat = np.ascontiguousarray(target[name]).reshape(-1)
        if mode == "exact":
            idx = np.flatnonzero(old_flat.view(np.uint32) != new_flat.view(np.uint32))
            values = new_flat[idx]
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                diff = (new_flat - old_flat).astype(np.float32)
            idx = np.flatnonzero(diff)
            values = diff[idx]
            _check_lossy(name, values, mode)
        if idx.size == 0:
            continue
        deltas[name] = TensorDelta(tuple(old.shape), np.ascontiguousarray(values, dtype=np.float32),
                                   None if idx.size == old_flat.size else idx.astype(np.int64))
    update = Update(deltas, 1, {MODE_KEY: _REPLACE if mode == "exact" else _ADD})
    return encode_update(update, header, UpdateOptions(values="fp32" if mode == "exact" else mode, zstd=True))


def apply_delta(base: Mapping[str, np.ndarray], blob: bytes | bytearray | memoryview, base_digest: str,
                limits: WireLimits = DEFAULT_LIMITS) -> dict[str, np.ndarray]:
    """``base`` with the delta ``blob`` applied (fresh arrays, the same tensor order).

    WireError when the blob is malformed, is not against ``base_digest``, names tensors or shapes
    ``base`` lacks, or has an unknown mode. The caller checks the result's digest."""
    shapes = {name: tuple(arr.shape) for name, arr in base.items()}
    decoded = decode_update(blob, limits, shapes=shapes)
    if decoded.header.base_digest != base_digest:
        raise WireError(f"model delta: it is against model {decoded.header.base_digest[:12]}, "
                        f"not the {base_digest[:12]} held")
    mode = decoded.update.info.get(MODE_KEY)
    if mode not in (_REPLACE, _ADD) or len(decoded.update.info) != 1:
        raise WireError(f"model delta: info must be exactly {MODE_KEY} = 0 (replace) or 1 (add)")
    out = {name: np.array(arr, dtype=np.float32, copy=True) for name, arr in base.items()}
    for name, d in decoded.update.deltas.items():
        flat = out[name].reshape(-1)
        idx = slice(None) if d.indices is None else d.indices
        if mode == _REPLACE:
            flat[idx] = d.values
        else:
            with np.errstate(over="ignore"):  # a sum beyond float32 is refused just below
                flat[idx] = flat[idx] + d.values
        if not np.isfinite(flat[idx]).all():
            raise WireError(f"model delta: tensor {name!r} is not finite once the delta is applied")
    return out
