"""The sparse-update blob: a client's masked deltas against a named global model, as bytes.

Layout (little-endian)::

    "FLSU"  u8 version=1  u8 flags (bit 0: zstd payload; other bits 0)
    u8 federation length F   u8 sender length S   u32 round   u32 num_samples (>= 1)
    32 bytes  sha256 of the global model blob the deltas are against
    u32 tensor count   u16 info count   F bytes federation   S bytes sender   (ids: [A-Za-z0-9_-])
    info count x (u8 key length 1..64, UTF-8 key, f64 finite value)
    payload (flags bit 0 clear) | u32 payload length + one zstd frame holding it (bit 0 set)

    payload = tensor count x tensor record, back to back, nothing after:
    u16 name length 1..1024, UTF-8 name (unique)
    u8 ndim   u8 value codec (see protocol.values)   u8 position method (protocol.sparse)   u8 rice k
    ndim x u32 dims   u32 count (<= numel)   u32 position bytes   u32 value bytes
    f32 scale (int8 only; 0 otherwise)   position bytes   value bytes

Decoding checks every field before it is used -- lengths against the bytes left, counts against
shapes and limits, positions in range and strictly increasing, values finite, known version and
codecs, the zstd output size -- and raises :class:`~protocol.errors.WireError` for anything else.
Given ``shapes`` (name -> shape of the global model), a tensor the model lacks or a shape that
differs is rejected before anything is allocated for it, and a zstd payload may not declare more
than :func:`payload_bound`: the most an honest encoder writes for that model (every tensor
dense, fp32), so a small zstd frame cannot make the receiver inflate more than the model holds.
:func:`read_update_head` reads the fixed header alone (no decompression), for the receiver's cheap
checks (sender, round, model digest, declared payload size) before any real work.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

from flayer.aggregate import UpdateError, check_update
from flayer.update import TensorDelta, Update

from ._reader import Reader
from .errors import EncodeError, InvalidUpdate, WireError
from .limits import DEFAULT_LIMITS, HARD_MAX_NUMEL, WireLimits
from .sparse import Method, decode_positions, encode_best
from .topics import TopicError, validate_id
from .values import VALUE_CODECS, ValueCodec, decode_values, encode_values, value_bytes, value_codec

__all__ = [
    "UPDATE_MAGIC",
    "UPDATE_VERSION",
    "DecodedUpdate",
    "UpdateHead",
    "UpdateHeader",
    "UpdateOptions",
    "decode_update",
    "encode_update",
    "payload_bound",
    "read_update_head",
    "update_sizer",
]

UPDATE_MAGIC = b"FLSU"
UPDATE_VERSION = 1
FLAG_ZSTD = 0x01
MAX_NAME_BYTES = 1024
MAX_INFO_KEY_BYTES = 64
_HEAD = struct.Struct("<4sBBBBII32sIH")
_RECORD = struct.Struct("<BBBB")
_SIZES = struct.Struct("<IIIf")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_METHODS = frozenset(int(m) for m in Method)
_VALUE_CODECS = frozenset(int(c) for c in ValueCodec)


@dataclass(frozen=True)
class UpdateHeader:
    """Who sent the update, for which round, against which global model (sha256 hex of its blob)."""

    federation: str
    round: int
    sender: str
    base_digest: str

    def problems(self) -> str | None:
        try:
            validate_id(self.federation, "federation id")
            validate_id(self.sender, "sender id")
        except TopicError as exc:
            return str(exc)
        if not isinstance(self.round, int) or not 0 <= self.round < 2**32:
            return f"round {self.round!r} must be an integer in [0, 2**32)"
        if not isinstance(self.base_digest, str) or not _DIGEST.fullmatch(self.base_digest):
            return f"base digest {self.base_digest!r} must be 64 lowercase hex characters (sha256)"
        return None


@dataclass(frozen=True)
class UpdateOptions:
    """``values``: fp32 (default, bit-exact) | fp16 | bf16 | int8; ``zstd``: compress the payload;
    ``zstd_masks``: let a tensor's positions be a zstd-compressed bitmask when that is smaller."""

    values: str = "fp32"
    zstd: bool = False
    zstd_level: int = 3
    zstd_masks: bool = True

    def __post_init__(self) -> None:
        if self.values not in VALUE_CODECS:
            raise EncodeError(f"unknown value codec {self.values!r}; choose one of {', '.join(VALUE_CODECS)}")
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise EncodeError(f"zstd_level must be in [1, 22], got {self.zstd_level!r}")


@dataclass(frozen=True)
class DecodedUpdate:
    header: UpdateHeader
    update: Update
    compressed: bool
    norm: float | None = None  # the update's L2 norm, when decoded against the model's shapes


# ---- encode -------------------------------------------------------------------------------------

def _check_delta(name: str, d: TensorDelta) -> tuple[bytes, int, np.ndarray | None]:
    if not isinstance(name, str) or not 1 <= len(name.encode("utf-8")) <= MAX_NAME_BYTES:
        raise EncodeError(f"tensor name {name!r} must be 1-{MAX_NAME_BYTES} bytes of UTF-8")
    shape = tuple(d.shape)
    if len(shape) > 255 or not all(isinstance(s, (int, np.integer)) and 0 <= s < 2**32 for s in shape):
        raise EncodeError(f"tensor {name!r}: bad shape {shape}")
    numel = math.prod(int(s) for s in shape)
    if numel > HARD_MAX_NUMEL:
        raise EncodeError(f"tensor {name!r}: {numel} elements exceed {HARD_MAX_NUMEL}")
    v = d.values
    if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.ndim != 1:
        raise EncodeError(f"tensor {name!r}: values must be a 1-D float32 array")
    if not np.isfinite(v).all():
        raise EncodeError(f"tensor {name!r}: NaN or Inf among the values")
    idx = d.indices
    if idx is None:
        if v.size != numel:
            raise EncodeError(f"tensor {name!r}: dense delta has {v.size} values for {numel} positions")
        return name.encode("utf-8"), numel, None
    if not isinstance(idx, np.ndarray) or idx.ndim != 1 or idx.dtype.kind not in "iu" or idx.size != v.size:
        raise EncodeError(f"tensor {name!r}: indices must be a 1-D integer array, one per value")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx[0] < 0 or idx[-1] >= numel or (idx.size > 1 and not (np.diff(idx) > 0).all())):
        raise EncodeError(f"tensor {name!r}: indices must be strictly increasing and in [0, {numel})")
    return name.encode("utf-8"), numel, idx


def encode_update(update: Update, header: UpdateHeader, options: UpdateOptions = UpdateOptions()) -> bytes:
    """Encode ``update`` (see module docstring); raises EncodeError for bad input."""
    problem = header.problems()
    if problem:
        raise EncodeError(problem)
    if not isinstance(update.num_samples, (int, np.integer)) or not 1 <= update.num_samples < 2**32:
        raise EncodeError(f"num_samples must be an integer in [1, 2**32), got {update.num_samples!r}")
    if len(update.info) >= 2**16:
        raise EncodeError("too many info entries")
    codec = value_codec(options.values)
    info = bytearray()
    for key, value in update.info.items():
        raw = key.encode("utf-8") if isinstance(key, str) else b""
        if not 1 <= len(raw) <= MAX_INFO_KEY_BYTES:
            raise EncodeError(f"info key {key!r} must be 1-{MAX_INFO_KEY_BYTES} bytes of UTF-8")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(value)):
            raise EncodeError(f"info {key!r}: value {value!r} must be a finite number")
        info += struct.pack("<B", len(raw)) + raw + struct.pack("<d", float(value))
    parts: list[bytes] = []
    for name, d in update.deltas.items():
        raw_name, numel, idx = _check_delta(name, d)
        method, k, pos = encode_best(idx, numel, options.zstd_masks)
        vals, scale = encode_values(d.values, codec)
        parts += [struct.pack("<H", len(raw_name)), raw_name, _RECORD.pack(len(d.shape), codec, method, k),
                  struct.pack(f"<{len(d.shape)}I", *d.shape),
                  _SIZES.pack(d.values.size, len(pos), len(vals), scale), pos, vals]
    payload = b"".join(parts)
    fed, snd = header.federation.encode("ascii"), header.sender.encode("ascii")
    head = _HEAD.pack(UPDATE_MAGIC, UPDATE_VERSION, FLAG_ZSTD if options.zstd else 0, len(fed), len(snd),
                      header.round, int(update.num_samples), bytes.fromhex(header.base_digest),
                      len(update.deltas), len(update.info)) + fed + snd + bytes(info)
    if options.zstd:
        frame = zstandard.ZstdCompressor(level=options.zstd_level, write_content_size=True).compress(payload)
        return head + struct.pack("<I", len(payload)) + frame
    return head + payload


def update_sizer(options: UpdateOptions = UpdateOptions()) -> Callable[[Update], int]:
    """``update -> bytes on the wire`` (a placeholder header of typical size), e.g. for a simulation."""
    header = UpdateHeader("federation", 1, "client-0000", "0" * 64)
    return lambda update: len(encode_update(update, header, options))


# ---- decode -------------------------------------------------------------------------------------

def payload_bound(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The largest payload (before compression) an encoder writes for a model of these tensor shapes:
    every tensor dense, fp32 values, its record header, and position bytes never above a bitmask's."""
    total = 0
    for name, shape in shapes.items():
        numel = math.prod(int(s) for s in shape)
        total += 2 + len(name.encode("utf-8")) + _RECORD.size + 4 * len(shape) + _SIZES.size
        total += 8 + (numel + 7) // 8 + 4 * numel
    return total


@dataclass(frozen=True)
class UpdateHead:
    """The fixed header of an update blob, read without touching its payload."""

    header: UpdateHeader
    num_samples: int
    tensors: int
    compressed: bool
    payload_bytes: int  # declared (zstd: the u32 before the frame) or actual (uncompressed)


def _read_head(r: Reader, limits: WireLimits) -> tuple[UpdateHead, int]:
    magic, version, flags, flen, slen, round_, num_samples, digest, ntensors, ninfo = _HEAD.unpack(
        r.take(_HEAD.size, "header"))
    if magic != UPDATE_MAGIC:
        raise WireError(f"update: bad magic {magic!r}")
    if version != UPDATE_VERSION:
        raise WireError(f"update: unsupported format version {version} (this decoder reads {UPDATE_VERSION})")
    if flags & ~FLAG_ZSTD:
        raise WireError(f"update: unknown flags {flags:#04x}")
    header = UpdateHeader(r.text(flen, "federation", ascii_only=True), round_,
                          r.text(slen, "sender", ascii_only=True), digest.hex())
    problem = header.problems()
    if problem:
        raise WireError(f"update: {problem}")
    if num_samples < 1:
        raise WireError("update: num_samples must be >= 1")
    if ntensors > limits.max_tensors or ninfo > limits.max_info:
        raise WireError(f"update: {ntensors} tensors / {ninfo} info entries exceed the limits "
                        f"({limits.max_tensors} / {limits.max_info})")
    return UpdateHead(header, num_samples, ntensors, bool(flags & FLAG_ZSTD), 0), ninfo


def read_update_head(data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> UpdateHead:
    """Header, sample count and declared payload size of an update blob, without decompressing or
    decoding its payload (cost: the header and info bytes). WireError when they are malformed."""
    r = Reader(data, "update")
    head, ninfo = _read_head(r, limits)
    for _ in range(ninfo):
        r.take(r.u8("info key length"), "info key")
        r.f64("info value")
    size = r.u32("payload length") if head.compressed else len(data) - r.pos
    return UpdateHead(head.header, head.num_samples, head.tensors, head.compressed, size)


def _decompress(r: Reader, limits: WireLimits, cap: int) -> memoryview:
    raw_len = r.u32("payload length")
    if raw_len > min(cap, limits.max_blob_bytes):
        raise WireError(f"update: payload of {raw_len} bytes exceeds the limit {min(cap, limits.max_blob_bytes)}")
    frame = r.rest()
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != raw_len:
            raise WireError(f"update: zstd frame declares {declared} bytes, header {raw_len}")
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise WireError(f"update: bad zstd payload ({exc})") from None
    if len(out) != raw_len:
        raise WireError(f"update: zstd payload gave {len(out)} bytes, declared {raw_len}")
    return memoryview(out)


def _read_tensor(r: Reader, limits: WireLimits, shapes: Mapping[str, tuple[int, ...]] | None,
                 seen: set[str], total: list[int]) -> tuple[str, TensorDelta]:
    name = r.text(r.u16("tensor name length"), "tensor name")
    if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise WireError(f"update: tensor name of {len(name)} characters")
    if name in seen:
        raise WireError(f"update: tensor {name!r} appears twice")
    seen.add(name)
    ndim, vcodec, method, k = _RECORD.unpack(r.take(_RECORD.size, f"tensor {name!r} record"))
    if ndim > limits.max_ndim:
        raise WireError(f"update: tensor {name!r} has {ndim} dimensions (limit {limits.max_ndim})")
    shape = struct.unpack(f"<{ndim}I", r.take(4 * ndim, f"tensor {name!r} shape"))
    numel = math.prod(shape)
    if numel > limits.max_numel:
        raise WireError(f"update: tensor {name!r} has {numel} elements (limit {limits.max_numel})")
    total[0] += numel
    if total[0] > limits.max_total_numel:
        raise WireError(f"update: tensors total more than {limits.max_total_numel} elements (the limit)")
    if shapes is not None:
        if name not in shapes:
            raise WireError(f"update: tensor {name!r} is not part of the global model")
        if tuple(shapes[name]) != shape:
            raise WireError(f"update: tensor {name!r} has shape {shape}, the model {tuple(shapes[name])}")
    count, pos_len, val_len, scale = _SIZES.unpack(r.take(_SIZES.size, f"tensor {name!r} sizes"))
    if count > numel:
        raise WireError(f"update: tensor {name!r} sends {count} values for {numel} elements")
    if method not in _METHODS or vcodec not in _VALUE_CODECS:
        raise WireError(f"update: tensor {name!r}: unknown position method {method} or value codec {vcodec}")
    # the value bytes bound count by the payload size; checked first, every allocation below stays
    # within a small multiple of the bytes actually received
    if val_len != value_bytes(ValueCodec(vcodec), count):
        raise WireError(f"update: tensor {name!r} has {val_len} value bytes for {count} "
                        f"{ValueCodec(vcodec).name} values")
    pos_buf = r.take(pos_len, f"tensor {name!r} positions")
    val_buf = r.take(val_len, f"tensor {name!r} values")
    try:
        indices = decode_positions(pos_buf, numel, count, method, k)
        values = decode_values(val_buf, vcodec, count, scale)
    except WireError as exc:
        raise WireError(f"update: tensor {name!r}: {exc.reason}") from None
    return name, TensorDelta(shape, values, indices)


def decode_update(data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS,
                  shapes: Mapping[str, tuple[int, ...]] | None = None,
                  expect: UpdateHeader | None = None) -> DecodedUpdate:
    """Decode and validate an update blob; WireError on anything invalid (see module docstring).

    ``shapes``: the global model's tensor shapes (reject unknown tensors and shape mismatches, then run
    ``flayer.aggregate.check_update``: :class:`InvalidUpdate` when it fails, ``norm`` set when it passes);
    ``expect``: the header the receiver expects (federation, round, sender, base digest).
    """
    if len(data) > limits.max_blob_bytes:
        raise WireError(f"update: {len(data)} bytes exceed the limit {limits.max_blob_bytes}")
    r = Reader(data, "update")
    head, ninfo = _read_head(r, limits)
    header, num_samples, ntensors = head.header, head.num_samples, head.tensors
    if expect is not None and header != expect:
        raise WireError(f"update: header {header} does not match the expected {expect}")
    cap = payload_bound(shapes) if shapes is not None else limits.max_blob_bytes
    info: dict[str, float] = {}
    for _ in range(ninfo):
        klen = r.u8("info key length")
        key = r.text(klen, "info key")
        value = r.f64(f"info {key!r}")
        if not 1 <= klen <= MAX_INFO_KEY_BYTES or key in info or not math.isfinite(value):
            raise WireError(f"update: info entry {key!r} is empty, repeated or not finite")
        info[key] = value
    body = Reader(_decompress(r, limits, cap) if head.compressed else r.rest(), "update payload")
    deltas: dict[str, TensorDelta] = {}
    seen: set[str] = set()
    total = [0]
    for _ in range(ntensors):
        name, delta = _read_tensor(body, limits, shapes, seen, total)
        deltas[name] = delta
    body.done()
    update = Update(deltas, num_samples, info)
    if shapes is None:
        return DecodedUpdate(header, update, head.compressed)
    try:  # the one validity gate (flayer.engine.gate): finite values, positive count; its norm
        norm = check_update(update, shapes)
    except UpdateError as exc:
        raise InvalidUpdate(f"update: {exc}") from None
    return DecodedUpdate(header, update, head.compressed, norm)
