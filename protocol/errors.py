"""The one error every decoder raises, and the one every encoder raises.

Anything decoded from the network that is malformed, truncated, inconsistent, over a size limit or
otherwise not what the format allows raises :class:`WireError` with a one-line ``reason``. No other
exception type escapes a decoder (``struct.error``, ``IndexError``, zstd and safetensors errors,
``MemoryError`` from an oversized allocation...): those are caught or, better, made impossible by
checking every length before it is used.

Encoders raise :class:`EncodeError` for bad input from the local program (a NaN delta, an
unsorted index array, an unknown codec): a bug or a misconfiguration on the sending side, not
hostile bytes.
"""

from __future__ import annotations

__all__ = ["EncodeError", "InvalidUpdate", "WireError"]


class WireError(ValueError):
    """Bytes received from the wire are not a valid payload; ``reason`` says what is wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidUpdate(WireError):
    """An update that decodes but does not fit the global model: non-finite values, a sample count that
    is not positive (``flayer.aggregate.check_update``, run by the decoder given the model's shapes)."""


class EncodeError(ValueError):
    """Local data cannot be encoded (non-finite values, bad positions, unknown option...)."""
