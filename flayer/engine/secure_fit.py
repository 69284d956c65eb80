"""A secure upload fitted to the link: a common share of the round's positions, drawn from public parameters.

A plain upload is fitted by each device alone (``edge_client.linkfit``: a lower codec, then its largest values).
A masked input cannot be: every device must mask the same coordinates, and which ones must depend on no
device's data. So the coordinator states one **keep fraction** per round and every device keeps the same
subset of the round's common layout: per tensor, the ``ceil(keep x count)`` positions whose ChaCha20 scores
under ``sha256("secagg-keep:<run seed>:<round>:<tensor>")`` are smallest (:func:`kept_offsets`) -- public,
fresh each round (the positions left out this round are drawn again the next), and recomputed by each device:
the plan's layout digest is the kept layout's, so a plan stating another subset or another length is refused.

The coordinator chooses the fraction (:func:`fitted_keep`) from what it knows of the selected devices' links:
the byte budget is linkfit's rule, ``rate x (seconds - MARGIN_S) x SAFETY``, at a low quantile of the reported
uplink rates (:func:`secure_budget`), and a secure upload is also capped at ``factor`` times what the plain link
fit would send for the same positions at that budget (``[privacy] secure_fit_factor``). Without any known rate
nothing is fitted (every common position); ``[privacy] secure_keep`` caps the fraction in any round (``flayer
simulate`` has no links: it is how a fixed fraction is measured there). docs/explanation/secure-aggregation.md,
"Fitted to the link".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from flayer.secagg.prg import expand
from flayer.update import TensorDelta, Update

from .secure_layout import Layout

__all__ = ["MARGIN_S", "MIN_KEEP", "PER_NEIGHBOUR_BYTES", "ROUND_BYTES", "SAFETY", "check_keep", "fitted_keep", "keep_layout",
           "kept_offsets", "masked_bytes", "restrict", "secure_budget"]

MIN_KEEP = 0.01  # the least share of the common positions a plan may state (devices refuse less)
SAFETY = 0.8  # as edge_client.linkfit: the share of the estimated capacity an upload may plan on
MARGIN_S = 1.0  # as edge_client.linkfit: seconds kept for the ack and clock skew
RATE_QUANTILE = 0.1  # the budget follows this low quantile of the selected devices' known uplink rates
# what a device sends beyond its masked input: per neighbour, 320 B measured without signatures
# (benchmarks/secagg_cost.py), the 64-byte signature over its keys toward that neighbour (signed adverts) and the
# 64-byte signature over the share it sealed for it (flayer.secagg.signed_shares); per round, the survivor-set
# signature (85 B with a 10-character id) and the advert's signature count, an upper figure
PER_NEIGHBOUR_BYTES = 320 + 64 + 64
ROUND_BYTES = 160
MASKED_HEADER = 96  # a MaskedInput's bytes beside its packed values (header, id, width, length), an upper figure


def check_keep(keep: object) -> float:
    """``keep`` as a float in [MIN_KEEP, 1]; ValueError otherwise."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not math.isfinite(keep) \
            or not MIN_KEEP <= keep <= 1.0:
        raise ValueError(f"the keep fraction must be a number in [{MIN_KEEP}, 1], got {keep!r}")
    return float(keep)


def kept_offsets(count: int, keep: float, seed: int, round_: int, name: str) -> np.ndarray | None:
    """Sorted offsets (into a tensor's ``count`` sent values) of the ``ceil(keep x count)`` kept ones, None: all
    (module docstring: drawn from the run seed, the round and the tensor's name only)."""
    k = max(1, math.ceil(check_keep(keep) * count - 1e-9))  # 0.3 x 600 is 180, not 181 (the float's last bit)
    if k >= count:
        return None
    key = hashlib.sha256(f"secagg-keep:{seed}:{round_}:{name}".encode()).digest()
    scores = expand(key, count)
    return np.sort(np.argsort(scores, kind="stable")[:k]).astype(np.int64)


def keep_layout(layout: Layout, keep: float, seed: int, round_: int) -> Layout:
    """The round's common layout cut to the kept positions (``layout`` itself when ``keep`` is 1)."""
    if check_keep(keep) >= 1.0:
        return layout
    indices: list[np.ndarray | None] = []
    for name, idx, count in zip(layout.names, layout.indices, layout.counts):
        off = kept_offsets(count, keep, seed, round_, name)
        indices.append(idx if off is None else (off if idx is None else np.asarray(idx, dtype=np.int64)[off]))
    return Layout(layout.names, layout.shapes, tuple(indices))


def restrict(update: Update, keep: float, seed: int, round_: int) -> Update:
    """``update`` (on the round's common layout) with only the kept positions' values (:func:`keep_layout`)."""
    if check_keep(keep) >= 1.0:
        return update
    deltas = {}
    for name, d in update.deltas.items():
        off = kept_offsets(d.count, keep, seed, round_, name)
        if off is None:
            deltas[name] = d
            continue
        values = np.asarray(d.values).reshape(-1)[off]
        deltas[name] = TensorDelta(d.shape, values, off if d.indices is None else np.asarray(d.indices)[off])
    return Update(deltas, update.num_samples, update.info)


def masked_bytes(length: int, bits: int) -> int:
    """The size of a masked input of ``length`` values at ``bits`` bits (an upper figure)."""
    return MASKED_HEADER + math.ceil(length * bits / 8)


def secure_budget(rates: Sequence[float], seconds: float) -> int:
    """The bytes a round's masked input may take (0: no rate known, nothing fitted): linkfit's rule at the
    :data:`RATE_QUANTILE` quantile (the slowest device of a small cohort) of ``rates`` (bytes/s)."""
    known = sorted(float(r) for r in rates if isinstance(r, (int, float)) and math.isfinite(r) and r > 0)
    if not known:
        return 0
    rate = known[int(RATE_QUANTILE * (len(known) - 1))]
    return max(1, int(rate * max(0.0, seconds - MARGIN_S) * SAFETY))


def fitted_keep(values: int, bits: int, neighbours: int, budget: int, ladder: Sequence[int], factor: float,
                limit: float = 1.0, floor: float = MIN_KEEP) -> float:
    """The round's keep fraction for ``values`` common positions at ``bits`` bits a value: the largest whose masked
    input fits ``budget`` and whose bytes sent (with the protocol's, ``neighbours`` x :data:`PER_NEIGHBOUR_BYTES`)
    are at most ``factor`` x what the plain link fit sends at that budget (the first size of ``ladder`` -- the plain
    codec ladder's sizes for the same positions, highest codec first -- within the budget, else the budget: a
    plain upload then keeps its largest values up to it); at most ``limit``, at least ``floor`` (a plain fit's
    ``[federation] fit_min_keep``, as a plain upload never keeps less; at least :data:`MIN_KEEP`). No budget (no
    rate known): ``limit``."""
    limit = check_keep(limit)
    if budget <= 0 or values <= 0:
        return limit
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"the fit factor must be a finite number >= 1, got {factor!r}")
    plain = next((s for s in ladder if s <= budget), budget)
    full = masked_bytes(values, bits) - MASKED_HEADER
    room = min(budget, factor * plain - neighbours * PER_NEIGHBOUR_BYTES - ROUND_BYTES) - MASKED_HEADER
    keep = math.floor(room / full * 1e4) / 1e4  # 4 decimals: the plan states it, every device recomputes from it
    return min(limit, max(MIN_KEEP, floor, keep))
