"""Error feedback: what a device's upload left out is kept and added to its next update.

A device that sends its update with a lossy value codec (fp16, int8) or only part of its masked
coordinates (a smaller top-k, :mod:`edge_client.linkfit`) loses the difference. With error
feedback the difference is kept as a dense per-tensor *residual* and added to the next update at
the positions that update sends: :func:`with_residual` adds it, :func:`left_out` computes the new
residual from what the coordinator will decode (:func:`as_decoded` runs the value codec both
ways). The invariant, round after round, is ``sum(sent, as decoded) + residual == sum(true deltas)``.

:class:`ResidualStore` keeps the residual on disk in the device's state folder, one safetensors
file per round it follows (``residual-<round>.safetensors``, written atomically before the upload
is stored or sent). Round ``r`` adds the residual of the latest earlier round, so a device that
crashed after writing round ``r``'s residual but before committing the round retrains ``r`` from
the same residual as before; files older than the one in use are deleted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from flayer.state import StateFileError, atomic_write
from flayer.update import TensorDelta, Update
from protocol import WireError, decode_state, encode_state
from protocol.values import decode_values, encode_values, value_codec

__all__ = ["ResidualStore", "as_decoded", "left_out", "with_residual"]

log = logging.getLogger(__name__)
_NAME = re.compile(r"residual-(\d{1,10})\.safetensors")


def _positions(d: TensorDelta) -> np.ndarray | slice:
    return slice(None) if d.indices is None else d.indices


def with_residual(update: Update, residual: Mapping[str, np.ndarray]) -> Update:
    """``update`` with the residual added at the positions it sends (the rest of the residual waits)."""
    deltas = {}
    for name, d in update.deltas.items():
        r = residual.get(name)
        if r is None or r.size != d.numel:
            deltas[name] = d
            continue
        values = (d.values + r.reshape(-1)[_positions(d)]).astype(np.float32)
        deltas[name] = TensorDelta(d.shape, values, d.indices)
    return Update(deltas, update.num_samples, update.info)


def as_decoded(update: Update, codec: str) -> Update:
    """``update`` as the coordinator decodes it after coding its values with ``codec``."""
    c = value_codec(codec)
    deltas = {}
    for name, d in update.deltas.items():
        buf, scale = encode_values(d.values, c)
        deltas[name] = TensorDelta(d.shape, decode_values(memoryview(buf), c, d.values.size, scale), d.indices)
    return Update(deltas, update.num_samples, update.info)


def left_out(full: Update, sent: Update, residual: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The next residual (flat float32 per tensor): the old one where ``full`` (the update with the residual added) sends
    nothing, ``full`` minus ``sent`` (as decoded; a subset of ``full``'s positions) where it does."""
    out = {name: np.array(r, dtype=np.float32, copy=True).reshape(-1) for name, r in residual.items()}
    for name, d in full.deltas.items():
        flat = out.setdefault(name, np.zeros(d.numel, np.float32))
        if flat.size != d.numel:  # the model changed shape: the old residual is meaningless
            flat = out[name] = np.zeros(d.numel, np.float32)
        flat[_positions(d)] = d.values
        s = sent.deltas.get(name)
        if s is not None:
            flat[_positions(s)] -= s.values
    return out


class ResidualStore:
    """The residuals of one device, ``<state_dir>/residual-<round>.safetensors``."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)

    def _rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.fullmatch(p.name)))

    def _path(self, round_: int) -> Path:
        return self.dir / f"residual-{round_}.safetensors"

    def before(self, round_: int) -> dict[str, np.ndarray]:
        """The residual left by the latest round before ``round_`` (empty when none)."""
        earlier = [r for r in self._rounds() if r < round_]
        if not earlier:
            return {}
        path = self._path(earlier[-1])
        try:
            state = decode_state(path.read_bytes())
        except (OSError, WireError) as exc:
            raise StateFileError(f"{path}: unreadable residual ({exc})") from exc
        return {k: v.astype(np.float32, copy=False) for k, v in state.items()}

    def save(self, round_: int, residual: Mapping[str, np.ndarray]) -> None:
        """Write the residual left by ``round_`` (atomically), then drop the files it supersedes."""
        atomic_write(self._path(round_), encode_state({k: np.ascontiguousarray(v, np.float32)
                                                       for k, v in residual.items()}))
        used = [r for r in self._rounds() if r < round_]
        for r in used[:-1]:  # keep the one this round started from: a retrained round needs it again
            self._path(r).unlink(missing_ok=True)
