"""A bounds-checked cursor over received bytes: every read checks the remaining length first."""

from __future__ import annotations

import struct

from .errors import WireError

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")


class Reader:
    """Reads little-endian fields from ``data``; ``what`` names the payload in error reasons."""

    def __init__(self, data: bytes | bytearray | memoryview, what: str) -> None:
        self.view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        self.pos = 0
        self.what = what

    @property
    def remaining(self) -> int:
        return len(self.view) - self.pos

    def take(self, n: int, field: str) -> memoryview:
        """The next ``n`` bytes; WireError if fewer remain (the length is checked before use)."""
        if n < 0 or n > self.remaining:
            raise WireError(f"{self.what}: truncated at {field} (needs {n} bytes, {self.remaining} left)")
        out = self.view[self.pos:self.pos + n]
        self.pos += n
        return out

    def _unpack(self, st: struct.Struct, field: str) -> tuple:
        return st.unpack(self.take(st.size, field))

    def u8(self, field: str) -> int:
        return int(self._unpack(_U8, field)[0])

    def u16(self, field: str) -> int:
        return int(self._unpack(_U16, field)[0])

    def u32(self, field: str) -> int:
        return int(self._unpack(_U32, field)[0])

    def u64(self, field: str) -> int:
        return int(self._unpack(_U64, field)[0])

    def f32(self, field: str) -> float:
        return float(self._unpack(_F32, field)[0])

    def f64(self, field: str) -> float:
        return float(self._unpack(_F64, field)[0])

    def text(self, n: int, field: str, ascii_only: bool = False) -> str:
        raw = bytes(self.take(n, field))
        try:
            return raw.decode("ascii" if ascii_only else "utf-8")
        except UnicodeDecodeError:
            kind = "ASCII" if ascii_only else "UTF-8"
            raise WireError(f"{self.what}: {field} is not valid {kind}") from None

    def rest(self) -> memoryview:
        return self.take(self.remaining, "rest")

    def done(self) -> None:
        if self.remaining:
            raise WireError(f"{self.what}: {self.remaining} unexpected trailing bytes")
