"""Server-side folding of sparse updates into the next global model, streaming.

FLAYER's server step (Eq. 10 / Algorithm 1, line 12) is a sample-weighted average of the clients'
masked models. Two readings of what happens at a coordinate that only some clients sent:

- ``carry`` (default): per coordinate, the weighted mean over the clients that sent it; the previous
  global value where nobody did.
- ``zero`` (Algorithm 1 read literally): masked-out entries count as zeros in the average over all
  clients, so a coordinate nobody sent becomes 0.

Both follow from three running sums per tensor -- sum_k n_k * delta_k, the per-coordinate sum of the
senders' weights, and the total weight -- so memory is O(model) whatever the number of clients.
Updates carry deltas against the previous global model; the aggregate of a client's model value is
``prev + delta``.

Two robust rules, for fleets that expect faulty or hostile devices (the rules Flower ships as
FedMedian and FedTrimmedAvg), applied per coordinate to the clients that sent it, unweighted, the
previous global value where nobody did:

- ``median``: the coordinate-wise median of the sent deltas;
- ``trimmed``: the coordinate-wise mean after dropping the ``floor(trim * c)`` smallest and largest
  of the ``c`` deltas sent for that coordinate (``trim`` in [0, 0.5)).

They keep every update until the round closes: memory O(model x updates) (:class:`RobustAggregator`).

Private rounds (docs/explanation/privacy.md) use neither: ``carry``'s per-coordinate mean breaks
differential privacy. Its denominator is the weight of those who sent a coordinate, so where one device
alone sent it, that device's value is divided by its own weight and lands in the model whole -- no
amount of noise on the *sum* covers a release whose scale depends on who took part, and the count of
senders per coordinate is itself data-dependent under top-k masks. :class:`DPSumAggregator` divides the
unweighted sum of the clipped uploads, plus the Gaussian noise, by a denominator fixed before the round
(``m``, the expected number of contributions: DP-FedAvg's fixed-denominator estimator, McMahan et al.
2018): ``prev + (sum_k Delta_k + N(0, sigma^2)) / m`` at the coordinates the uploads carry, the previous
value elsewhere. One device changes that sum by at most its clip bound C, whoever else took part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: protocol imports check_update, and a broker needs no torch
    import torch

from flayer.secagg.prg import KeystreamRandom

from .update import TensorDelta, Update

__all__ = ["ROBUST_RULES", "SERVER_RULES", "Aggregator", "DPSumAggregator", "RobustAggregator", "UpdateError", "check_update",
           "is_finite_state", "make_aggregator"]

ROBUST_RULES = ("median", "trimmed")
SERVER_RULES = ("carry", "zero", *ROBUST_RULES)
DEFAULT_TRIM = 0.2  # Flower's FedTrimmedAvg default (beta)


class UpdateError(ValueError):
    """An update does not fit the global model (unknown tensor, wrong shape, bad positions, ...)."""


def check_update(update: Update, shapes: Mapping[str, tuple[int, ...]], max_norm: float | None = None) -> float:
    """Validate ``update`` against the global model's tensor shapes; return its L2 norm.

    Raises UpdateError naming the tensor and what is wrong.
    """
    if update.num_samples <= 0:
        raise UpdateError(f"num_samples must be positive, got {update.num_samples}")
    sq = 0.0
    for name, d in update.deltas.items():
        if name not in shapes:
            raise UpdateError(f"tensor {name!r} is not part of the global model")
        if tuple(d.shape) != tuple(shapes[name]):
            raise UpdateError(f"tensor {name!r}: shape {tuple(d.shape)} != global {tuple(shapes[name])}")
        numel = int(np.prod(shapes[name], dtype=np.int64))
        if d.values.ndim != 1:
            raise UpdateError(f"tensor {name!r}: values must be one-dimensional")
        if d.indices is None:
            if d.values.size != numel:
                raise UpdateError(f"tensor {name!r}: dense delta has {d.values.size} values, expected {numel}")
        else:
            idx = d.indices
            if idx.ndim != 1 or idx.size != d.values.size:
                raise UpdateError(f"tensor {name!r}: {idx.size} positions for {d.values.size} values")
            if idx.size:
                if idx[0] < 0 or idx[-1] >= numel:
                    raise UpdateError(f"tensor {name!r}: positions outside [0, {numel})")
                if idx.size > 1 and not bool((idx[1:] > idx[:-1]).all()):
                    raise UpdateError(f"tensor {name!r}: positions are not strictly increasing")
        sq += _squared_norm(name, d.values)
    norm = math.sqrt(sq)
    if max_norm is not None and norm > max_norm:
        raise UpdateError(f"update norm {norm:.4g} exceeds the bound {max_norm:.4g}")
    return norm


def _squared_norm(name: str, values: np.ndarray) -> float:
    """Sum of squares, in float64; UpdateError on NaN or Inf. Not a float32 dot product: its accumulators drop
    every square under half an ulp of their running sums, and an upload built of a few large values and very many
    small ones would pass for shorter than it is (and be clipped by too little)."""
    with np.errstate(over="ignore", invalid="ignore"):  # NaN and Inf are handled just below
        s = float(np.sum(np.square(values, dtype=np.float64)))
    if math.isfinite(s):
        return s
    if not bool(np.isfinite(values).all()):
        raise UpdateError(f"tensor {name!r}: non-finite values (NaN or Inf)")
    return s  # finite float64 values whose squares overflow: an infinite norm, over any bound


class Aggregator:
    """Streaming weighted mean of sparse deltas (see module docstring for the rules).

    ``fold`` adds one checked update; ``result`` gives the next global state. Per-coordinate
    weight arrays are only allocated for tensors that receive sparse deltas; dense deltas add to a
    per-tensor scalar.
    """

    def __init__(self, global_state: Mapping[str, torch.Tensor], rule: str = "carry") -> None:
        if rule not in ("carry", "zero"):
            raise ValueError(f"the streaming rules are carry and zero, got {rule!r} (see make_aggregator)")
        self.rule = rule
        self._prev = {k: v.detach().cpu() for k, v in global_state.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self._prev.items()}
        self._sum: dict[str, np.ndarray] = {}  # float64 flat, allocated on first delta
        self._w_dense: dict[str, float] = {k: 0.0 for k in self._prev}
        self._w_sparse: dict[str, np.ndarray] = {}
        self.total_weight = 0.0
        self.contributors = 0

    def fold(self, update: Update, weight: float | None = None) -> None:
        """Add ``update`` with ``weight`` (default: its num_samples). The update passed the validity gate
        (:func:`check_update`, run by the decoder or the simulator: ``flayer.engine.gate``)."""
        w = _weight(update, weight)
        for name, d in update.deltas.items():
            self._add(name, d, w)
        self.total_weight += w
        self.contributors += 1

    def _add(self, name: str, d: TensorDelta, w: float) -> None:
        acc = self._sum.get(name)
        if acc is None:
            acc = self._sum[name] = np.zeros(d.numel, dtype=np.float64)
        if d.indices is None:
            acc += w * d.values.astype(np.float64)
            self._w_dense[name] += w
            return
        acc[d.indices] += w * d.values.astype(np.float64)
        ws = self._w_sparse.get(name)
        if ws is None:
            ws = self._w_sparse[name] = np.zeros(d.numel, dtype=np.float64)
        ws[d.indices] += w

    def coordinate_weight(self, name: str) -> np.ndarray:
        """Per-coordinate sum of the weights of the clients that sent it (flat)."""
        ws = self._w_sparse.get(name)
        base = np.full(int(np.prod(self.shapes[name], dtype=np.int64)), self._w_dense[name])
        return base if ws is None else base + ws

    def unsent(self) -> int:
        """Coordinates of the global model that no folded update carried: what rule ``zero`` sets to 0
        and rule ``carry`` keeps."""
        total = 0
        for name, shape in self.shapes.items():
            if name not in self._sum:
                total += int(np.prod(shape, dtype=np.int64))
            elif self._w_dense[name] == 0:
                total += int(np.count_nonzero(self._w_sparse[name] == 0))
        return total

    def result(self) -> dict[str, torch.Tensor]:
        """The next global state (fp32). Nothing folded: the previous state, unchanged."""
        import torch

        out: dict[str, torch.Tensor] = {}
        for name, prev in self._prev.items():
            acc = self._sum.get(name)
            if acc is None or self.total_weight == 0:
                out[name] = prev.clone() if self.rule == "carry" or self.total_weight == 0 else torch.zeros_like(prev)
                continue
            p = prev.numpy().reshape(-1).astype(np.float64)
            wc = self.coordinate_weight(name)
            if self.rule == "carry":
                new = np.where(wc > 0, p + acc / np.where(wc > 0, wc, 1.0), p)
            else:
                new = (p * wc + acc) / self.total_weight
            with np.errstate(over="ignore"):  # an overflow to Inf is the caller's to detect (is_finite_state)
                out[name] = torch.from_numpy(new.astype(np.float32).reshape(self.shapes[name]))
        return out


def _weight(update: Update, weight: float | None) -> float:
    w = float(update.num_samples if weight is None else weight)
    if not (w > 0 and math.isfinite(w)):
        raise UpdateError(f"aggregation weight must be positive and finite, got {w}")
    return w


class RobustAggregator:
    """Coordinate-wise ``median`` or ``trimmed`` mean of the deltas each coordinate received
    (module docstring). Same interface as :class:`Aggregator`; weights only count contributors."""

    def __init__(self, global_state: Mapping[str, torch.Tensor], rule: str = "median",
                 trim: float = DEFAULT_TRIM) -> None:
        if rule not in ROBUST_RULES:
            raise ValueError(f"robust rule must be one of {ROBUST_RULES}, got {rule!r}")
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        self.rule, self.trim = rule, trim
        self._prev = {k: v.detach().cpu() for k, v in global_state.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self._prev.items()}
        self._sent: dict[str, list[TensorDelta]] = {k: [] for k in self._prev}
        self.total_weight = 0.0
        self.contributors = 0

    def fold(self, update: Update, weight: float | None = None) -> None:
        self.total_weight += _weight(update, weight)
        for name, d in update.deltas.items():
            self._sent[name].append(d)
        self.contributors += 1

    def unsent(self) -> int:
        total = 0
        for name, shape in self.shapes.items():
            total += int(np.count_nonzero(self._stack(name)[1] == 0)) if self._sent[name] \
                else int(np.prod(shape, dtype=np.int64))
        return total

    def _stack(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(k x numel float32, NaN where a client sent nothing, each column sorted; per-column count)."""
        numel = int(np.prod(self.shapes[name], dtype=np.int64))
        rows = np.full((len(self._sent[name]), numel), np.nan, dtype=np.float32)
        for row, d in zip(rows, self._sent[name]):
            if d.indices is None:
                row[:] = d.values
            else:
                row[d.indices] = d.values
        count = np.count_nonzero(~np.isnan(rows), axis=0)
        rows.sort(axis=0)  # NaN sorts last: column j holds its count[j] sent values first
        return rows, count

    def _robust(self, name: str) -> np.ndarray:
        """Per coordinate: the rule's value over the sent deltas (0 where nothing was sent)."""
        rows, c = self._stack(name)
        if self.rule == "median":
            lo = np.take_along_axis(rows, np.maximum((c - 1) // 2, 0)[None], 0)[0].astype(np.float64)
            hi = np.take_along_axis(rows, np.maximum(c // 2, 0)[None], 0)[0].astype(np.float64)
            out = (lo + hi) / 2
        else:
            t = np.floor(self.trim * c).astype(np.int64)
            cs = np.zeros((rows.shape[0] + 1, rows.shape[1]), dtype=np.float64)
            np.cumsum(np.nan_to_num(rows, nan=0.0), axis=0, dtype=np.float64, out=cs[1:])
            total = np.take_along_axis(cs, (c - t)[None], 0)[0] - np.take_along_axis(cs, t[None], 0)[0]
            out = total / np.maximum(c - 2 * t, 1)
        return np.where(c > 0, out, 0.0)

    def result(self) -> dict[str, torch.Tensor]:
        import torch

        out: dict[str, torch.Tensor] = {}
        for name, prev in self._prev.items():
            if not self._sent[name]:
                out[name] = prev.clone()
                continue
            p = prev.numpy().reshape(-1).astype(np.float64)
            new = p + self._robust(name)
            with np.errstate(over="ignore"):  # an overflow to Inf is the caller's to detect (is_finite_state)
                out[name] = torch.from_numpy(new.astype(np.float32).reshape(self.shapes[name]))
        return out


class DPSumAggregator:
    """The fixed-denominator noised sum of private rounds (module docstring). ``noise_std``: std of the
    noise on each summed coordinate (0 in local mode: the devices added it); ``seed``: None (every
    driver that publishes a model) draws the noise from a generator keyed by the operating system's
    CSPRNG, so no party can regenerate it; an int seeds it, for ``flayer simulate --dp-seeded-noise``
    alone (reproducible, and not private: anyone who knows the seed subtracts the noise); ``bit_std`` > 0: adaptive
    clipping, the clip bits the updates report (``info[bit_key]``, read as 0 or 1) are summed and noised
    too (:meth:`noised_bits`). The noise is drawn in one fixed order -- the bit count first, then each
    tensor in the global model's order, at the sorted positions the uploads carried -- so two drivers
    folding the same uploads publish the same model."""

    def __init__(self, global_state: Mapping[str, torch.Tensor], contributions: int, noise_std: float,
                 seed: int | None = None, bit_std: float = 0.0, bit_key: str = "dp_unclipped") -> None:
        if contributions < 1 or not (noise_std >= 0 and math.isfinite(noise_std)):
            raise ValueError(f"need contributions >= 1 and a finite noise std >= 0, got {contributions}, {noise_std}")
        self._prev = {k: v.detach().cpu() for k, v in global_state.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self._prev.items()}
        self.m, self.noise_std, self.seed, self.bit_std, self.bit_key = contributions, noise_std, seed, bit_std, bit_key
        self._sum: dict[str, np.ndarray] = {}
        self._sent: dict[str, np.ndarray] = {}  # bool per coordinate: some upload carried it
        self.bits = 0.0  # clip bits folded (a noised secure sum's may be fractional)
        self.total_weight = 0.0
        self.contributors = 0
        self._out: tuple[dict[str, torch.Tensor], float] | None = None
        self._noise: Mapping[str, np.ndarray] | None = None  # use_noise

    def use_noise(self, noise: Mapping[str, np.ndarray]) -> None:
        """The round's banded noise (flayer.engine.correlated), a flat vector a tensor, for all of a tensor sent."""
        assert all(k in noise and noise[k].size == int(np.prod(s)) for k, s in self.shapes.items()), "a vector a tensor"
        self._noise, self._out = noise, None

    def fold(self, update: Update, weight: float | None = None) -> None:
        """Add a clipped upload, unweighted (``weight`` is checked, not used: DP bounds each device's
        share by C, not by its sample count)."""
        self.total_weight += _weight(update, weight)
        for name, d in update.deltas.items():
            acc = self._sum.get(name)
            if acc is None:
                acc = self._sum[name] = np.zeros(d.numel, dtype=np.float64)
                self._sent[name] = np.zeros(d.numel, dtype=bool)
            if d.indices is None:
                acc += d.values.astype(np.float64)
                self._sent[name][:] = True
            else:
                acc[d.indices] += d.values.astype(np.float64)
                self._sent[name][d.indices] = True
        self.bits += int(float(update.info.get(self.bit_key, 0.0)) >= 0.5)
        self.contributors += 1
        self._out = None

    def fold_sum(self, total: Update, count: int, bits: float = 0.0, noised: bool = False) -> None:
        """Add the unmasked sum of ``count`` clipped uploads at once (a secure round: the coordinator never
        sees one of them); ``bits``: the sum of their clip bits (adaptive clipping). ``noised``: the sum and bits
        carry the round's central noise already (drawn before the secure round's checks,
        :func:`flayer.engine.secure.sum_update`), so none is added again."""
        if count < 1:
            raise ValueError(f"a secure sum folds >= 1 uploads, got {count}")
        self.fold(Update(total.deltas, max(1, total.num_samples), {}))
        self.contributors += count - 1
        if noised:
            self.noise_std, self.bit_std = 0.0, 0.0
            self.bits += float(bits)
        else:
            self.bits += int(round(bits))

    def unsent(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) if n not in self._sent else int(np.count_nonzero(~self._sent[n]))
                   for n, s in self.shapes.items())

    def _draw(self) -> tuple[dict[str, torch.Tensor], float]:
        import torch

        # the OS's entropy keys a ChaCha20 keystream (a CSPRNG); seeded only under --dp-seeded-noise (not private)
        rng: Any = KeystreamRandom() if self.seed is None else np.random.default_rng(self.seed)  # seeded: protects nothing
        # the clip bits centred at +-1/2 (Andrew et al. 2021; TF Privacy's QuantileEstimatorQuery); under zero-out
        # neighbours one device still moves the count by 1 (a zero upload reports bit 1), the sensitivity the
        # accountant's z_Delta assumes (flayer.engine.privacy); + m/2 puts the noised figure back on the count's scale
        centred = self.bits - self.contributors / 2
        noised_bits = centred + (float(rng.normal(0.0, self.bit_std)) if self.bit_std > 0 else 0.0) + self.m / 2
        out: dict[str, torch.Tensor] = {}
        for name, prev in self._prev.items():
            acc = self._sum.get(name)
            if acc is None:
                out[name] = prev.clone()
                continue
            pos = np.flatnonzero(self._sent[name]) if self._noise is None else np.arange(acc.size)  # banded: all
            total = acc[pos] + (self._noise[name][pos] if self._noise is not None else
                                rng.normal(0.0, self.noise_std, pos.size) if self.noise_std > 0 else 0.0)
            new = prev.numpy().reshape(-1).astype(np.float64)
            new[pos] += total / self.m
            with np.errstate(over="ignore"):
                out[name] = torch.from_numpy(new.astype(np.float32).reshape(self.shapes[name]))
        return out, noised_bits

    def result(self) -> dict[str, torch.Tensor]:
        """The next global state: ``prev + (sum + noise) / m`` where uploads carried a coordinate."""
        if self._out is None:
            self._out = self._draw()
        return {k: v.clone() for k, v in self._out[0].items()}

    def noised_bits(self) -> float:
        """Adaptive clipping: the count of unclipped uploads, estimated as ``sum_k (b_k - 1/2) + N(0, bit_std^2)
        + m / 2`` (sensitivity 1 under zero-out neighbours: flayer.engine.privacy)."""
        if self._out is None:
            self._out = self._draw()
        return self._out[1]


def make_aggregator(global_state: Mapping[str, torch.Tensor], rule: str = "carry",
                    trim: float = DEFAULT_TRIM) -> Any:
    """The aggregator of server rule ``rule`` (``carry``, ``zero``, ``median`` or ``trimmed``)."""
    if rule not in SERVER_RULES:
        raise ValueError(f"server rule must be one of {SERVER_RULES}, got {rule!r}")
    if rule in ROBUST_RULES:
        return RobustAggregator(global_state, rule, trim)
    return Aggregator(global_state, rule)


def is_finite_state(state: Mapping[str, torch.Tensor]) -> str | None:
    """None when every tensor of ``state`` is finite, else the name of the first that is not."""
    import torch

    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None
