"""Delta downloads on the device: fetch the change from the model it holds, rebuild, verify.

When the plan offers a delta (:class:`protocol.model_delta.DeltaRef`, its own ``delta`` or a link of
its ``delta_chain``) from the very model this device holds, :func:`delta_source` returns it and the
client downloads the delta's retained chunks instead of the model's, then the next link's, until it
holds the plan's model. :func:`rebuild` applies it (:func:`protocol.model_delta.apply_delta`) and
returns the model blob only when its sha256 is the plan's model digest; a decode error, a delta
against another model or a digest mismatch raises WireError, and the client then downloads the
full model. So a wrong or tampered delta can never become the device's model.

:class:`HeldModel` keeps the last global model's blob in the device's state folder
(``global_model.bin``, written atomically), so a rebooted device still holds a base for the next
delta -- or, when the plan names that very model, needs no download at all. Its digest is computed
from the bytes read, so a damaged file is just a different (unused) model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from flayer.state import atomic_write
from flayer.update import state_numpy
from protocol import Plan, WireError, WireLimits, blob_digest, encode_state
from protocol.model_delta import DeltaRef, apply_delta, chain_refs, delta_ref

__all__ = ["HeldModel", "delta_source", "rebuild"]

log = logging.getLogger(__name__)


def delta_source(plan: Plan, held: tuple[str, Mapping[str, torch.Tensor]] | None) -> DeltaRef | None:
    """The delta of the plan's chain that starts from the model ``held`` (digest, state), else None: the
    plan's own ``delta`` (to the plan's model) or an older link of its ``delta_chain`` (to the next
    version; the client then takes the next step from there)."""
    if held is None or held[0] == plan.model_digest:
        return None
    try:
        refs = [*chain_refs(plan.delta_chain), *([r] if (r := delta_ref(plan.delta)) is not None else [])]
    except WireError as exc:  # the plan's own check makes this unreachable for decoded plans
        log.warning("ignoring the plan's delta: %s", exc.reason)
        return None
    return next((ref for ref in refs if ref.base == held[0]), None)


def rebuild(delta_blob: bytes, ref: DeltaRef, plan: Plan, held_state: Mapping[str, torch.Tensor],
            limits: WireLimits) -> tuple[bytes, str]:
    """(the model blob rebuilt from the held model and ``delta_blob``, its digest): the delta's target,
    the plan's model for the plan's own delta. WireError unless the digest is that target."""
    if len(delta_blob) != ref.size:
        raise WireError(f"model delta: {len(delta_blob)} bytes, the plan says {ref.size}")
    state = apply_delta(state_numpy(held_state), delta_blob, ref.base, limits)
    blob = encode_state(state)
    target = ref.target or plan.model_digest
    if blob_digest(blob) != target:
        raise WireError(f"model delta: the rebuilt model is {blob_digest(blob)[:12]}, the plan names "
                        f"{target[:12]}")
    return blob, target


class HeldModel:
    """The last global model this device held, ``<state_dir>/global_model.bin``."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "global_model.bin"

    def save(self, blob: bytes) -> None:
        atomic_write(self.path, blob)

    def load(self, limits: WireLimits) -> tuple[str, bytes] | None:
        """(digest, blob) of the stored model, or None when there is none or it is over the limits."""
        try:
            if self.path.stat().st_size > limits.max_blob_bytes:
                return None
            blob = self.path.read_bytes()
        except OSError:
            return None
        return blob_digest(blob), blob
