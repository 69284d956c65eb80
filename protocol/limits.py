"""Size limits every decoder enforces before it allocates anything.

One frozen dataclass shared by all decoders, so a deployment sets its bounds in one place (the
coordinator from its model size, a device from its memory). Defaults fit ResNet-18-sized models
(about 45 MB of fp32) with room to spare.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "HARD_MAX_NUMEL", "WireLimits"]

# Positions and counts travel as u32; keeping every tensor below 2**31 elements also keeps every
# position sum the decoders form far from int64 overflow.
HARD_MAX_NUMEL = 2**31 - 1


@dataclass(frozen=True)
class WireLimits:
    max_blob_bytes: int = 256 * 2**20  # a reassembled model or update blob (and its zstd output)
    max_chunks: int = 65_536  # chunks per blob
    max_json_bytes: int = 256 * 2**10  # the body of a plan / ack / status / metrics message
    max_tensors: int = 4_096  # tensors in a model blob or layers in an update
    max_numel: int = 2**28  # elements of one tensor
    max_total_numel: int = 2**28  # elements of all tensors of one blob together
    max_ndim: int = 8
    max_info: int = 64  # entries of an update's info map

    def __post_init__(self) -> None:
        for name in ("max_blob_bytes", "max_chunks", "max_json_bytes", "max_tensors", "max_numel",
                     "max_total_numel", "max_ndim", "max_info"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"WireLimits.{name} must be a positive integer, got {value!r}")
        if self.max_numel > HARD_MAX_NUMEL:
            raise ValueError(f"WireLimits.max_numel must be <= {HARD_MAX_NUMEL}, got {self.max_numel}")
        if self.max_blob_bytes > 2**32 - 1 or self.max_chunks > 2**32 - 1:
            raise ValueError("WireLimits.max_blob_bytes and max_chunks must fit in 32 bits")
        if self.max_ndim > 32:
            raise ValueError(f"WireLimits.max_ndim must be <= 32, got {self.max_ndim}")


DEFAULT_LIMITS = WireLimits()
