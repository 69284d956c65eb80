"""Delta downloads on the device: fetch the change from the model it holds, rebuild, verify.

When the plan offers a delta (:class:`protocol.model_delta.DeltaRef`, its own ``delta`` or a link of
its ``delta_chain``) from the very model this device holds, :func:`delta_source` returns it and the
client downloads the delta's retained chunks instead of the model's, then the next link's, until it
holds the plan's model; it never takes a link from a model to itself, nor one that does not lead to
the plan's model, and the client takes at most ``MAX_DELTA_STEPS`` deltas towards one plan's model
before it fetches the full model (:mod:`edge_client.fetch`). :func:`rebuild` applies it
(:func:`protocol.model_delta.apply_delta`) and returns the model blob only when its sha256 is the
link's target; a decode error, a delta against another model or a digest mismatch raises WireError,
and the client then downloads the full model. So a wrong or tampered delta can never become the device's model.

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
    """The delta of the plan's chain to take next from the model ``held`` (digest, state), else None: the
    plan's own ``delta`` (to the plan's model) or an older link of its ``delta_chain`` (to the next
    version; the client then takes the next step from there). Rules:

    1. nothing to fetch when nothing is held or the held model is the plan's;
    2. a link whose base is its target (from a model to itself) is never taken;
    3. only a link on a path of links from the held model to the plan's model is taken: the first step of
       the shortest such path, so every step brings the device nearer; no path -> None (the full model);
    4. the path's deltas together must be smaller than the plan's model (``model_size``): a device that
       missed several rounds takes the full model when it costs fewer bytes than the deltas' walk."""
    if held is None or held[0] == plan.model_digest:
        return None
    try:
        refs = [*chain_refs(plan.delta_chain), *([r] if (r := delta_ref(plan.delta)) is not None else [])]
    except WireError as exc:  # the plan's own check makes this unreachable for decoded plans
        log.warning("ignoring the plan's delta: %s", exc.reason)
        return None
    links = [(ref, ref.target or plan.model_digest) for ref in refs]
    links = [(ref, target) for ref, target in links if target != ref.base]
    first: dict[str, DeltaRef] = {}  # a model reached -> the first step of the path that reached it
    cost = {held[0]: 0}  # a model reached -> the bytes of the deltas on the path to it
    seen, frontier = {held[0]}, [held[0]]
    while frontier and plan.model_digest not in first:  # breadth first: each model is reached once
        nxt = []
        for digest in frontier:
            for ref, target in links:
                if ref.base == digest and target not in seen:
                    seen.add(target)
                    first[target] = first.get(digest, ref)
                    cost[target] = cost[digest] + ref.size
                    nxt.append(target)
        frontier = nxt
    if plan.model_digest in first and 0 < plan.model_size <= cost[plan.model_digest]:
        log.info("model deltas from %s: %d bytes, the model %d: taking the model", held[0][:12],
                 cost[plan.model_digest], plan.model_size)
        return None
    return first.get(plan.model_digest)


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
