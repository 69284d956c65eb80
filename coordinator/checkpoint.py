"""The coordinator's checkpoint: the global model after round r and what the run needs to go on.

One safetensors file, ``checkpoint.safetensors``, written atomically after each round (through
:func:`flayer.state.save_tensors`): the global state plus JSON metadata -- the round, the model's
digest, the run's identity (strategy, options, seed, training settings, model spec, federation) and
the cumulative counters; in a private run, the accountant's ledger and the clip bound
(:mod:`coordinator.privacy`); the devices a secure round proved faulty, with the proof (left out of later
rounds after a restart too: :mod:`coordinator.secure_phase`). Selection needs no saved RNG state: each round's draw is seeded from
(seed, round). A checkpoint of another run (different strategy, seed, model...) is refused, so a
state folder cannot silently mix two runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flayer.state import StateFileError, load_tensors, save_tensors

__all__ = ["CHECKPOINT_NAME", "Checkpoint", "CheckpointError", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.safetensors"
KIND = "coordinator_checkpoint"


class CheckpointError(RuntimeError):
    """The checkpoint is unreadable or belongs to another run."""


@dataclass
class Checkpoint:
    round: int  # rounds complete
    global_state: dict[str, torch.Tensor]
    model_digest: str
    identity: dict[str, Any]  # what must match to resume
    counters: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # strategy options in force (after calibration)
    norms: list[float] = field(default_factory=list)  # recent accepted update norms (coordinator.guard)
    window: dict[str, Any] = field(default_factory=dict)  # asynchronous rounds: flayer.engine.VersionWindow
    norm_clients: list[str] = field(default_factory=list)  # ... and whose each was ("" unknown: older checkpoints)
    privacy: dict[str, Any] = field(default_factory=dict)  # private runs: the accountant's ledger and C
    excluded: dict[str, str] = field(default_factory=dict)  # secure rounds: device -> the proof of its fault


def save_checkpoint(folder: Path, ckpt: Checkpoint) -> Path:
    """Write the checkpoint atomically (the previous one stays whole when this fails). An I/O error is
    raised as OSError naming the checkpoint's path."""
    meta = {"kind": KIND, "round": ckpt.round, "model_digest": ckpt.model_digest, "identity": ckpt.identity,
            "counters": ckpt.counters, "options": ckpt.options, "norms": [float(n) for n in ckpt.norms],
            "norm_clients": list(ckpt.norm_clients) if len(ckpt.norm_clients) == len(ckpt.norms)
            else [""] * len(ckpt.norms), "window": ckpt.window, "privacy": ckpt.privacy,
            "excluded": dict(ckpt.excluded)}
    path = folder / CHECKPOINT_NAME
    try:
        return save_tensors(path, ckpt.global_state, meta)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def load_checkpoint(folder: Path, identity: Mapping[str, Any]) -> Checkpoint | None:
    """The checkpoint in ``folder`` (None when there is none); CheckpointError when it is unreadable
    or its run differs from ``identity``."""
    path = folder / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        tensors, meta = load_tensors(path)
    except StateFileError as exc:
        raise CheckpointError(str(exc)) from exc
    if (meta.get("kind") != KIND or not isinstance(meta.get("round"), int)
            or not isinstance(meta.get("identity"), dict)):
        raise CheckpointError(f"{path} is not a coordinator checkpoint")
    if meta["identity"] != dict(identity):
        diff = sorted(k for k in set(meta["identity"]) | set(identity)
                      if meta["identity"].get(k) != identity.get(k))
        raise CheckpointError(f"{path} belongs to another run (differs in {', '.join(diff)}); use another "
                              f"state_dir, or remove it to start over")
    return Checkpoint(meta["round"], tensors, str(meta.get("model_digest", "")), meta["identity"],
                      {str(k): int(v) for k, v in dict(meta.get("counters", {})).items()},
                      dict(meta.get("options", {})), _norms(meta.get("norms", [])), _window(meta.get("window", {})),
                      _norm_clients(meta.get("norm_clients"), len(meta.get("norms", []))),
                      _window(meta.get("privacy", {})), _excluded(meta.get("excluded", {})))


MAX_EXCLUDED = 1_000_000  # more named devices than any fleet holds: the file was not written by a coordinator
MAX_ID, MAX_PROOF = 256, 4096


def _excluded(raw: Any) -> dict[str, str]:
    """The devices a secure round proved faulty (device id -> proof), checked: a checkpoint is a file."""
    if not isinstance(raw, dict) or len(raw) > MAX_EXCLUDED:
        raise CheckpointError(f"checkpoint: 'excluded' must be an object of at most {MAX_EXCLUDED} devices")
    for device, proof in raw.items():
        if not (isinstance(device, str) and 0 < len(device) <= MAX_ID and isinstance(proof, str)
                and len(proof) <= MAX_PROOF):
            raise CheckpointError(f"checkpoint: 'excluded' must map device ids (1-{MAX_ID} characters) to proofs "
                                  f"(at most {MAX_PROOF} characters); found {str(device)[:40]!r}")
    return dict(raw)


def _norm_clients(raw: Any, n: int) -> list[str]:
    if raw is None:
        return [""] * n
    if not isinstance(raw, list) or len(raw) != n or not all(isinstance(c, str) for c in raw):
        raise CheckpointError("checkpoint: 'norm_clients' must be a list of device ids, one per norm")
    return list(raw)


def _norms(raw: Any) -> list[float]:
    if not isinstance(raw, list) or not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in raw):
        raise CheckpointError("checkpoint: 'norms' must be a list of numbers")
    return [float(n) for n in raw]


def _window(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CheckpointError("checkpoint: 'window' must be an object")
    return raw
