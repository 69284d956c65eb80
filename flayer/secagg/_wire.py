"""A bounds-checked cursor over received bytes and the writers that match it (:mod:`.messages`).

Every read checks the remaining length first and names the field it was reading in the error, so a
truncated or garbled message fails with a :class:`~flayer.secagg.errors.SecAggError` that says where.
"""

from __future__ import annotations

import re
import struct

from .errors import SecAggError

__all__ = [
    "ID_PATTERN",
    "MAX_ENTRIES",
    "Reader",
    "check_bytes",
    "check_id",
    "check_list",
    "check_round",
    "header",
    "open_message",
    "pack_id",
    "pack_u16",
    "pack_u32",
]

# the project's device and federation ids: 1-64 of [A-Za-z0-9_-] (the MQTT topic rule)
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAGIC = b"FLSA"
VERSION = 1
MAX_ENTRIES = 1025  # a device's k <= 1024 neighbours and itself
MAX_MESSAGE = 16 + 4 * 2**26 + 256  # a masked input of 2^26 coordinates and its header
_HEAD = struct.Struct("<4sBBI")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def check_id(value: object, what: str) -> str:
    """``value`` if it is a valid device id, else SecAggError naming ``what``."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise SecAggError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return value


def pack_id(value: str) -> bytes:
    raw = value.encode("ascii")
    return _U8.pack(len(raw)) + raw


def pack_u16(value: int, what: str) -> bytes:
    if not 0 <= value <= 0xFFFF:
        raise SecAggError(f"{what} {value} does not fit in 16 bits")
    return _U16.pack(value)


def pack_u32(value: int, what: str) -> bytes:
    if not 0 <= value <= 0xFFFFFFFF:
        raise SecAggError(f"{what} {value} does not fit in 32 bits")
    return _U32.pack(value)


class Reader:
    """Reads little-endian fields from ``data``; ``what`` names the message in error reasons."""

    def __init__(self, data: bytes | bytearray | memoryview, what: str) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SecAggError(f"{what}: expected bytes, got {type(data).__name__}")
        self.view = memoryview(data).cast("B")
        self.pos = 0
        self.what = what

    @property
    def remaining(self) -> int:
        return len(self.view) - self.pos

    def take(self, n: int, field: str) -> bytes:
        if n < 0 or n > self.remaining:
            raise SecAggError(f"{self.what}: truncated at {field} (needs {n} bytes, {self.remaining} left)")
        out = bytes(self.view[self.pos:self.pos + n])
        self.pos += n
        return out

    def u8(self, field: str) -> int:
        return int(_U8.unpack(self.take(1, field))[0])

    def u16(self, field: str) -> int:
        return int(_U16.unpack(self.take(2, field))[0])

    def u32(self, field: str) -> int:
        return int(_U32.unpack(self.take(4, field))[0])

    def device(self, field: str) -> str:
        n = self.u8(f"{field} length")
        raw = self.take(n, field)
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise SecAggError(f"{self.what}: {field} is not ASCII") from None
        try:
            return check_id(text, field)
        except SecAggError as exc:
            raise SecAggError(f"{self.what}: {exc}") from None

    def count(self, field: str, limit: int) -> int:
        n = self.u16(field)
        if n > limit:
            raise SecAggError(f"{self.what}: {field} {n} exceeds the limit {limit}")
        return n

    def done(self) -> None:
        if self.remaining:
            raise SecAggError(f"{self.what}: {self.remaining} unexpected trailing bytes")


def header(kind: int, round_id: int) -> bytes:
    return _HEAD.pack(MAGIC, VERSION, kind, round_id)


def check_round(round_id: object) -> None:
    if not isinstance(round_id, int) or isinstance(round_id, bool) or not 0 <= round_id <= 0xFFFFFFFF:
        raise SecAggError(f"round must be an integer in [0, 2^32), got {round_id!r}")


def check_bytes(value: object, length: int, what: str) -> None:
    if not isinstance(value, bytes) or len(value) != length:
        raise SecAggError(f"{what} must be {length} bytes")


def check_list(ids: tuple[str, ...], what: str) -> None:
    if len(ids) > MAX_ENTRIES:
        raise SecAggError(f"{what}: {len(ids)} entries exceed the limit {MAX_ENTRIES}")
    for i in ids:
        check_id(i, what)
    if len(set(ids)) != len(ids):
        raise SecAggError(f"{what}: duplicate device")


def open_message(data: bytes, kind: int, what: str) -> tuple[Reader, int]:
    r = Reader(data, what)
    if len(r.view) > MAX_MESSAGE:
        raise SecAggError(f"{what}: {len(r.view)} bytes exceed any message")
    magic, version, got = r.take(4, "magic"), r.u8("version"), r.u8("kind")
    if magic != MAGIC:
        raise SecAggError(f"{what}: bad magic {magic!r}")
    if version != VERSION:
        raise SecAggError(f"{what}: unsupported version {version}")
    if got != kind:
        raise SecAggError(f"{what}: kind {got} is not {kind}")
    return r, r.u32("round")
